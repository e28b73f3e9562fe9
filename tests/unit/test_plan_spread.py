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
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan import pair
from pdserve.workers.plan.contention import POINT, level_spread, pair_median
from pdserve.workers.plan.costs import (
    CONTENTION_STEPS,
    MAX_SPREAD_PIECES,
    SERVING_CONTEXT,
    SPREAD_POINTS,
    Contention,
    Profile,
    ServingOverhead,
    StepSpread,
)
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from support.plan import CPU_LIKE, constant_profile, model_config_dir, scenario_line

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


def serving_spread(
    model_dir: Path, ratios: list[float], step_s: float = STEP_S, typical_s: float | None = None
) -> Profile:
    """Every step `step_s`, drawn from `ratios` measured on steps of `typical_s`."""
    serving = ServingOverhead(spread=StepSpread.of(ratios, typical_s))
    profile: Profile = constant_profile(model_dir, step_s).model_copy(update={"serving": serving})
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
    # Measured on steps of the mean of the medians of each worker's kinds of step.
    assert spread.typical_s == pytest.approx((0.020 + 0.005 + 0.022 + 0.006) / 4)
    assert spread.quantiles[0] == pytest.approx(1.0)
    assert spread.quantiles[-1] == pytest.approx(3.0)
    assert pair_median(one) == pytest.approx(0.025)


def test_a_step_as_long_as_the_measured_ones_draws_as_one_did_before() -> None:
    measured = StepSpread.of(SLICED, typical_s=STEP_S)
    one, per_length = random.Random(3), random.Random(3)
    for seconds in (None, STEP_S / 4, STEP_S, 1.4 * STEP_S):
        assert measured.pieces(seconds) == 1
        assert measured.draw(per_length, seconds) == measured.draw(one)
    # Without the measured steps' length, a step of any length draws once.
    assert StepSpread.of(SLICED).pieces(100 * STEP_S) == 1


def test_a_long_step_draws_as_many_pieces_of_the_measured_length() -> None:
    spread = StepSpread.of(SLICED, typical_s=STEP_S)
    assert spread.pieces(2.4 * STEP_S) == 2
    assert spread.pieces(10 * STEP_S) == 10
    assert spread.pieces(10_000 * STEP_S) == MAX_SPREAD_PIECES


def test_a_long_step_runs_slow_as_often_on_average_but_by_less_of_its_time() -> None:
    # One step in twenty of the measured length waits out a slice (3x): a step ten
    # times as long meets about one slice in two, each costing a tenth of its time.
    spread = StepSpread.of(SLICED, typical_s=STEP_S)
    rng = random.Random(0)
    short = np.array([spread.draw(rng, STEP_S) for _ in range(20_000)])
    long = np.array([spread.draw(rng, 10 * STEP_S) for _ in range(20_000)])
    assert np.mean(short) == pytest.approx(1.1, abs=0.01)
    assert np.mean(long) == pytest.approx(1.1, abs=0.01)  # as much slower on average
    assert np.percentile(short, 99) == pytest.approx(3.0, rel=0.01)
    assert np.percentile(long, 99) <= 1.6  # two or three slices at most, of ten pieces
    assert np.mean(long > 1.5) < 0.02


def test_the_simulated_gaps_of_long_steps_have_a_shorter_tail(model_dir: Path) -> None:
    long_s = 10 * STEP_S
    (measured_on_long,) = run(serving_spread(model_dir, SLICED, long_s, typical_s=long_s))
    (measured_on_short,) = run(serving_spread(model_dir, SLICED, long_s, typical_s=STEP_S))
    assert np.percentile(np.diff(measured_on_long), 99) > 2.5 * long_s
    tail = np.percentile(np.diff(measured_on_short), 99)
    assert 1.1 * long_s < tail < 1.7 * long_s


def test_a_profile_without_the_serving_steps_length_takes_its_batches_by_the_model() -> None:
    # The serving measurement's streams are the context the fallback assumes.
    assert pair.STREAM_PROMPT_TOKENS + pair.STREAM_OUTPUT_TOKENS // 2 == SERVING_CONTEXT
    per_token = 1e-4
    serving = ServingOverhead(
        per_token_s=per_token, samples=((1, 0.0), (4, 0.0), (16, 0.0)),
        spread=StepSpread.of(SLICED),
    )  # fmt: skip
    # The 16-stream batch saw 16 of the 21 streams' gaps: its step is the median.
    step = StepFeatures(decode_tokens=16, decode_keys=16 * SERVING_CONTEXT)
    drawn = serving.drawn_spread(CPU_LIKE)
    assert drawn.typical_s == pytest.approx(CPU_LIKE.seconds(step) + 16 * per_token)
    assert drawn.quantiles == serving.spread.quantiles
    # Recorded, it is kept; no spread, nothing to draw.
    recorded = serving.model_copy(update={"spread": StepSpread.of(SLICED, 0.02)})
    assert recorded.drawn_spread(CPU_LIKE).typical_s == 0.02
    assert ServingOverhead().drawn_spread(CPU_LIKE) == StepSpread()


def test_a_profile_without_the_contention_steps_length_takes_them_by_the_model() -> None:
    decodes = ((POINT.context, 1),) * POINT.decodes
    assert ((*decodes, (POINT.start, POINT.prefill)), decodes) == CONTENTION_STEPS
    contention = Contention(spreads=((2, StepSpread.of(SLICED)),))
    expected = sum(CPU_LIKE.seconds(StepFeatures.of_spans(s)) for s in CONTENTION_STEPS) / 2
    assert contention.drawn_spread(2, CPU_LIKE).typical_s == pytest.approx(expected)
    assert contention.drawn_spread(1, CPU_LIKE) == StepSpread()
