"""The contention a pool's workers step under beside the router and the load
generator: the level measured on the profile's pair (each round's pool phase over its
lone phase), the slowdown a pool of so many processes gets from it, and the
simulator's steps on a shared host taking it; on nodes of their own, none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.plan.costs import (
    POOL_PROMPT_ROUNDS,
    Contention,
    Profile,
    ServingOverhead,
    Spread,
    StepCost,
)
from pdserve.workers.plan.hosts import ROUTER_AND_CLIENT
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.pool_level import (
    POOL_PROCESSES,
    PROMPT_STEP_TOKENS,
    pool_level,
    typical_ratio,
)
from pdserve.workers.plan.scenario import parse_scenario
from pdserve.workers.plan.step_log import LoggedStep
from support.plan import constant_profile, model_config_dir, scenario_line

STEP_S = 0.01
COST = StepCost(
    base_s=0.004, per_decode_token_s=0.001, per_prefill_token_s=0.0001,
    per_decode_key_s=0.0, per_prefill_key_s=0.0,
)  # fmt: skip


def decodes(count: int, ratio: float) -> LoggedStep:
    """A decode-only step of `count` decodes that took `ratio` times the model's."""
    spans = tuple((64 + i, 1) for i in range(count))
    return LoggedStep(spans, ratio * (0.004 + 0.001 * count))


def prompt(tokens: int, ratio: float, count: int = 4) -> LoggedStep:
    """A step of a prompt's chunk of `tokens` beside `count` decodes that took `ratio`
    times the model's."""
    spans = ((0, tokens), *((64 + i, 1) for i in range(count)))
    return LoggedStep(spans, ratio * (0.004 + 0.001 * count + 0.0001 * tokens))


def test_a_rounds_slowdown_is_its_pool_phases_typical_step_over_its_lone_phases() -> None:
    # The lone phases' decode-only steps run 1.1x the model, the pool phases' 1.43x,
    # 1.65x and 1.32x: slowdowns 1.3, 1.5, 1.2; the level kept is their median.
    alone = [decodes(4, 1.1), decodes(8, 1.1), decodes(2, 1.1)]
    rounds = [(alone, [decodes(n, 1.1 * s) for n in (4, 12, 6)]) for s in (1.3, 1.5, 1.2)]
    levels = pool_level(rounds, COST)
    assert levels.decode[0] == (1, 1.0)
    assert levels.decode[1][0] == POOL_PROCESSES
    assert levels.decode[1][1] == pytest.approx(1.3)
    assert levels.spreads["contention.pool_slowdown"].rounds == pytest.approx((1.3, 1.5, 1.2))
    lone = levels.spreads["contention.pool_phase.lone_decode_over_model"]
    assert lone.rounds == pytest.approx((1.1, 1.1, 1.1))


def test_steps_that_carry_a_prompt_do_not_move_the_typical_step() -> None:
    step = LoggedStep(((0, 256), (70, 1)), 1.0)  # far beyond the model: not counted
    assert typical_ratio([decodes(4, 1.2), step, decodes(4, 1.2)], COST) == pytest.approx(1.2)


def test_a_round_without_decode_only_steps_in_a_phase_is_left_out() -> None:
    levels = pool_level([([decodes(4, 1.0)], [prompt(256, 1.0, count=0)])], COST)
    assert levels.decode == ((1, 1.0),)
    assert levels.spreads["contention.pool_slowdown"].rounds == ()


def test_steps_carrying_a_prompt_get_a_level_of_their_own() -> None:
    # In each round the pool slows the decode-only steps 1.2x and the prompts' steps
    # 1.5x, 1.6x, 1.4x (over 1.0x and 1.1x the model alone): each kind keeps its own.
    rounds = [
        (
            [decodes(4, 1.0), prompt(128, 1.1), decodes(4, 1.0), prompt(128, 1.1)],
            [decodes(4, 1.2), prompt(128, 1.1 * s), decodes(6, 1.2), prompt(128, 1.1 * s)],
        )
        for s in (1.5, 1.6, 1.4)
    ]
    levels = pool_level(rounds, COST)
    assert [count for count, _ in levels.decode] == [1, POOL_PROCESSES]
    assert [level for _, level in levels.decode] == pytest.approx([1.0, 1.2])
    assert [count for count, _ in levels.prompt] == [1, POOL_PROCESSES]
    assert [level for _, level in levels.prompt] == pytest.approx([1.0, 1.5])
    slowdowns = levels.spreads["contention.pool_prompt_slowdown"].rounds
    assert slowdowns == pytest.approx((1.5, 1.6, 1.4))
    lone = levels.spreads["contention.pool_phase.lone_prompt_over_model"].rounds
    assert lone == pytest.approx((1.1, 1.1, 1.1))
    # The pool phase's prompt steps over the model, as one figure: the rounds' median.
    assert levels.spreads[POOL_PROMPT_ROUNDS].rounds == pytest.approx((1.65, 1.76, 1.54))
    assert levels.prompt_over_model == pytest.approx(1.65)


def test_only_the_prompts_sent_count_as_prompt_steps() -> None:
    # A load generator's short prompt (under PROMPT_STEP_TOKENS) is neither kind.
    steps = [prompt(128, 1.3), prompt(PROMPT_STEP_TOKENS - 1, 3.0), decodes(4, 1.0)]
    assert typical_ratio(steps, COST, prompt=True) == pytest.approx(1.3)
    assert typical_ratio(steps, COST) == pytest.approx(1.0)


def test_with_no_prompt_steps_measured_they_take_the_decode_steps_level() -> None:
    contention = Contention(pool=((1, 1.0), (4, 1.3)))
    assert contention.pool_slowdown(4, prompt=True) == pytest.approx(1.3)
    both = contention.model_copy(update={"pool_prompt": ((1, 1.0), (4, 1.6))})
    assert both.pool_slowdown(4, prompt=True) == pytest.approx(1.6)
    assert both.pool_slowdown(3, prompt=True) == pytest.approx(1.4)
    assert both.pool_slowdown(4) == pytest.approx(1.3)


def test_a_pools_slowdown_grows_with_its_processes_through_the_measured_level() -> None:
    contention = Contention(pool=((1, 1.0), (4, 1.3)))
    assert contention.pool_slowdown(4) == pytest.approx(1.3)
    assert contention.pool_slowdown(3) == pytest.approx(1.2)  # one worker, router, client
    assert contention.pool_slowdown(5) == pytest.approx(1.4)
    assert Contention().pool_slowdown(5) == 1.0  # not measured (an older profile)
    assert Contention(pool=((1, 1.0), (4, 0.9))).pool_slowdown(4) == 1.0  # never faster


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = model_config_dir(tmp_path_factory.mktemp("model"))
    return directory


def first_token_times(profile: Profile, placement: str, num_decode: int) -> list[float]:
    """Each request's TTFT: one one-token prompt per worker, all at once."""
    line = scenario_line("pool-level", [], num_decode=num_decode, placement=placement)
    plan = [PlannedRequest(i, 0.0, 16, 1, "t") for i in range(num_decode)]
    simulation = PoolSimulation(parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None))
    records = simulation.run()
    assert all(record.finished for record in records)
    return sorted(record.chunk_times[0] - (record.sent_at or 0.0) for record in records)


def measured_profile(model_dir: Path) -> Profile:
    """Steps of STEP_S alone on a 4-core machine (two workers do not share a core),
    whose pool of four processes measured 1.3x."""
    profile: Profile = constant_profile(model_dir, STEP_S).model_copy(
        update={"cores": 4, "contention": Contention(pool=((1, 1.0), (4, 1.3)))}
    )
    return profile


def test_a_pools_workers_on_one_host_step_slower_by_its_processes(model_dir: Path) -> None:
    profile = measured_profile(model_dir)
    assert ROUTER_AND_CLIENT == 2  # a worker alone is three processes busy: 1.2x
    assert first_token_times(profile, "one-host", 1) == pytest.approx([STEP_S * 1.2])
    assert first_token_times(profile, "one-host", 2) == pytest.approx([STEP_S * 1.3] * 2)


def test_workers_on_nodes_of_their_own_take_no_pool_slowdown(model_dir: Path) -> None:
    times = first_token_times(measured_profile(model_dir), "node-per-worker", 2)
    assert times == [STEP_S, STEP_S]


def test_a_simulated_prompt_step_takes_its_kinds_level_and_a_decode_step_its_own(
    model_dir: Path,
) -> None:
    # One worker (three processes: 1.2x decode-only, 1.4x with a prompt): a prompt of
    # 16 tokens in one step, then its decode steps.
    profile = measured_profile(model_dir)
    contention = profile.contention.model_copy(update={"pool_prompt": ((1, 1.0), (4, 1.6))})
    profile = profile.model_copy(update={"contention": contention})
    line = scenario_line("pool-level", [], placement="one-host")
    plan = [PlannedRequest(0, 0.0, 16, 4, "t")]
    simulation = PoolSimulation(parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None))
    (record,) = simulation.run()
    assert record.chunk_times[0] - (record.sent_at or 0.0) == pytest.approx(STEP_S * 1.4)
    assert list(np.diff(record.chunk_times)) == pytest.approx([STEP_S * 1.2] * 3)


def test_the_pool_phases_prompt_ratio_is_read_from_older_profiles_spreads(
    model_dir: Path,
) -> None:
    profile = constant_profile(model_dir, STEP_S)
    assert profile.prompt_over_model() is None
    older = profile.model_copy(
        update={"spreads": {POOL_PROMPT_ROUNDS: Spread(rounds=(1.2, 1.5, 1.3))}}
    )
    assert older.prompt_over_model() == pytest.approx(1.3)
    recorded = older.model_copy(update={"contention": Contention(pool_prompt_over_model=1.1)})
    assert recorded.prompt_over_model() == pytest.approx(1.1)


def prompt_then_decodes(profile: Profile, placement: str) -> tuple[float, list[float]]:
    """One worker: a prompt of 16 tokens in one step, then its decode steps; its
    TTFT and gaps."""
    line = scenario_line("pool-level", [], placement=placement)
    plan = [PlannedRequest(0, 0.0, 16, 4, "t")]
    simulation = PoolSimulation(parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None))
    (record,) = simulation.run()
    return record.chunk_times[0] - (record.sent_at or 0.0), list(np.diff(record.chunk_times))


def test_a_simulated_prompt_step_runs_at_the_pool_phases_ratio_to_the_model(
    model_dir: Path,
) -> None:
    # The lone worker's prompt steps measured 0.8x the model, the pool's levels 1.6x
    # over that at four processes: the pool phase itself measured its prompt steps at
    # 1.5x the model. One worker is three processes: 1.5x by the levels' growth from
    # four processes to three (1.4 / 1.6). Decode steps keep their own level (1.2x).
    profile = measured_profile(model_dir)
    contention = profile.contention.model_copy(
        update={"pool_prompt": ((1, 1.0), (4, 1.6)), "pool_prompt_over_model": 1.5}
    )
    serving = ServingOverhead(mixed_factor=0.8)
    profile = profile.model_copy(update={"contention": contention, "serving": serving})
    assert profile.pool_prompt_factor(4) == pytest.approx(1.5 / 0.8)
    ttft, gaps = prompt_then_decodes(profile, "one-host")
    assert ttft == pytest.approx(STEP_S * 1.5 * 1.4 / 1.6)
    assert gaps == pytest.approx([STEP_S * 1.2] * 3)
    # On a node of its own, no pool: the lone worker's prompt step.
    ttft, gaps = prompt_then_decodes(profile, "node-per-worker")
    assert ttft == pytest.approx(STEP_S * 0.8)
    assert gaps == pytest.approx([STEP_S] * 3)
