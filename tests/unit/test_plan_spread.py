"""Steps are not all alike: the profile keeps the measured spread of step times around
the typical one (a serving worker's gaps, and steps of workers stepping together on
shared cores), and the simulator draws each step's time from it with a fixed seed, so
a pool's latency tails come out as tails instead of as a uniformly slower step."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.plan.contention import level_spread, pair_median
from pdserve.workers.plan.costs import (
    SPREAD_POINTS,
    Contention,
    Profile,
    ServingOverhead,
    StepSpread,
)
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from support.plan import constant_profile, model_config_dir, scenario_line

STEP_S = 0.01
# One step in twenty waits out a time slice and takes three times as long.
SLICED = [1.0] * 95 + [3.0] * 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_config_dir(tmp_path_factory.mktemp("model"))


def test_a_spread_keeps_the_measured_quantiles_of_step_over_typical_time() -> None:
    spread = StepSpread.of([*SLICED, 0.0, -1.0])  # a zero or negative time is no step
    assert spread.samples == 100
    assert len(spread.quantiles) == SPREAD_POINTS
    assert spread.quantiles[0] == 1.0 and spread.quantiles[-1] == 3.0
    assert spread.quantiles[50] == 1.0  # the typical step keeps its time


def test_draws_follow_the_spread_and_repeat_with_the_seed() -> None:
    spread = StepSpread.of(SLICED)
    draws = [spread.draw(random.Random("w")) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    rng = random.Random(0)
    many = np.array([spread.draw(rng) for _ in range(20_000)])
    assert np.median(many) == 1.0
    assert np.mean(many > 1.5) == pytest.approx(0.05, abs=0.01)
    assert np.percentile(many, 99.5) == pytest.approx(3.0, rel=0.01)


def test_no_spread_measured_leaves_every_step_at_its_predicted_time() -> None:
    rng = random.Random(0)
    state = rng.getstate()
    assert StepSpread().draw(rng) == 1.0
    assert rng.getstate() == state  # nothing drawn


def run(profile: Profile, outputs: int = 400, requests: int = 1) -> list[list[float]]:
    """Each request's token times: `requests` prompts of 16 tokens at once."""
    line = scenario_line("spread", ["--max-num-batched-tokens", "64"])
    plan = [PlannedRequest(i, 0.0, 16, outputs, "t") for i in range(requests)]
    simulation = PoolSimulation(parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None))
    records = simulation.run()
    assert all(record.finished for record in records)
    return [record.chunk_times for record in records]


def serving_spread(model_dir: Path, ratios: list[float]) -> Profile:
    serving = ServingOverhead(spread=StepSpread.of(ratios))
    profile: Profile = constant_profile(model_dir, STEP_S).model_copy(update={"serving": serving})
    return profile


def test_the_simulated_gaps_have_the_measured_tail(model_dir: Path) -> None:
    (times,) = run(serving_spread(model_dir, SLICED))
    gaps = np.diff(times)
    assert np.median(gaps) == pytest.approx(STEP_S)
    assert np.percentile(gaps, 99) > 2.5 * STEP_S  # the slow steps, not an average stretch
    assert np.mean(gaps > 1.5 * STEP_S) == pytest.approx(0.05, abs=0.03)
    # Without a spread every gap is the step's predicted time.
    (plain,) = run(constant_profile(model_dir, STEP_S))
    assert np.diff(plain) == pytest.approx([STEP_S] * (len(plain) - 1))


def test_a_simulation_with_a_spread_repeats_exactly(model_dir: Path) -> None:
    profile = serving_spread(model_dir, SLICED)
    assert run(profile, outputs=50, requests=3) == run(profile, outputs=50, requests=3)


def test_the_contention_spread_is_the_highest_level_measured_up_to_the_workers() -> None:
    two, three = StepSpread.of([1.0, 2.0]), StepSpread.of([1.0, 4.0])
    contention = Contention(spreads=((1, StepSpread.of([9.0])), (2, two), (3, three)))
    assert contention.spread(1) == StepSpread()  # a lone worker's is its serving's
    assert contention.spread(2) == two
    assert contention.spread(3) == three
    assert contention.spread(5) == three
    assert Contention().spread(3) == StepSpread()


def test_workers_stepping_together_draw_from_their_levels_spread(model_dir: Path) -> None:
    doubled = StepSpread.of([2.0])  # every step of two workers together: twice as long
    profile: Profile = constant_profile(model_dir, STEP_S).model_copy(
        update={"cores": 4, "contention": Contention(spreads=((2, doubled),))}
    )  # fmt: skip
    line = scenario_line("spread", [], num_decode=2, placement="one-host")
    plan = [PlannedRequest(i, 0.0, 16, 1, "t") for i in range(2)]
    simulation = PoolSimulation(parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None))
    first, second = simulation.run()
    # The first step starts alone (no spread); the second starts beside it.
    assert first.chunk_times == [pytest.approx(STEP_S)]
    assert second.chunk_times == [pytest.approx(2 * STEP_S)]


def test_a_contention_levels_spread_is_each_kind_of_step_over_its_own_median() -> None:
    # Two workers' (mixed, decode-only) pairs: one slow mixed step, one slow decode.
    one = [(0.020, 0.005), (0.020, 0.005), (0.060, 0.005)]
    two = [(0.022, 0.006), (0.022, 0.018), (0.022, 0.006)]
    spread = level_spread([one, two])
    assert spread.samples == 12
    assert spread.quantiles[0] == pytest.approx(1.0)
    assert spread.quantiles[-1] == pytest.approx(3.0)
    assert pair_median(one) == pytest.approx(0.025)
