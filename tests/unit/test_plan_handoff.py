"""The hand-off's cost as a profile measures it: on the idle pair in rounds (each
length's colocated and handed-over prompts alternating, the lengths in alternate
orders), each length's median over the rounds fitted; as a pool runs, handed-over
prompts against colocated ones in turn; and the simulated disaggregated request
waiting the pool's figure where a profile has it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.plan.costs import HandoffCost, Profile
from pdserve.workers.plan.pair import fit_handoff_rounds
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.pool_level import HandedWaits, handoff_wait
from pdserve.workers.plan.scenario import parse_scenario
from support.plan import constant_profile, model_config_dir, scenario_line

STEP_S = 0.01
SPLIT: list[dict[str, Any]] = [
    {"maxInputTokens": 64, "mode": "colocated"},
    {"mode": "disaggregated"},
]
KIB = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = model_config_dir(tmp_path_factory.mktemp("model"))
    return directory


def handed(fixed_s: float, per_byte_s: float, nbytes: int) -> tuple[int, float]:
    return nbytes, fixed_s + per_byte_s * nbytes


def test_each_lengths_median_over_the_rounds_gives_the_fit() -> None:
    # 5 ms plus 1 ns a byte; one round stalls at one length (+80 ms), another reads
    # its shortest length 3 ms fast: neither moves the fit.
    lengths = (32 * KIB, 256 * KIB, 1024 * KIB, 3072 * KIB)
    true = [handed(0.005, 1e-9, n) for n in lengths]
    stalled = [(n, s + (0.08 if n == lengths[2] else 0.0)) for n, s in true]
    fast = [(n, s - (0.003 if n == lengths[0] else 0.0)) for n, s in true]
    cost, spreads = fit_handoff_rounds([true, stalled[::-1], fast], "nixl")
    assert cost.fixed_s == pytest.approx(0.005)
    assert cost.per_byte_s == pytest.approx(1e-9)
    assert cost.backend == "nixl"
    assert [n for n, _ in cost.samples] == list(lengths)
    # Each round's own fit is its spread: the stalled round reads 5x the fixed cost.
    assert len(spreads["handoff.fixed_s"].rounds) == 3
    assert spreads["handoff.fixed_s"].rounds[0] == pytest.approx(0.005)
    assert spreads["handoff.per_byte_s"].rounds[0] == pytest.approx(1e-9)
    assert spreads["handoff.fixed_s"].rounds[1] > 0.02


def test_negative_lengths_count_as_none_and_the_fit_stays_non_negative() -> None:
    rounds = [[(32 * KIB, -0.002), (1024 * KIB, 0.004)] for _ in range(3)]
    cost, _ = fit_handoff_rounds(rounds, "nixl")
    assert cost.fixed_s >= 0 and cost.per_byte_s >= 0
    assert cost.seconds(1024 * KIB) == pytest.approx(0.004, rel=0.01)


def test_a_pools_hand_off_wait_is_each_rounds_handed_over_beyond_colocated() -> None:
    # Handed over 30 ms beyond colocated in one round, 20 in another; one request of
    # each round stalled by 200 ms moves its round's figure by at most one step of
    # the sorted differences. A round without colocated prompts gives nothing.
    rounds = [
        HandedWaits(handed=[0.08, 0.081, 0.079, 0.28], colocated=[0.05, 0.051, 0.049]),
        HandedWaits(handed=[0.07, 0.071, 0.069], colocated=[0.05, 0.051, 0.249]),
        HandedWaits(handed=[0.07], colocated=[]),
    ]
    waits = handoff_wait(rounds)
    assert len(waits.rounds) == 2
    assert waits.rounds[0] == pytest.approx(0.030, abs=0.002)
    assert waits.rounds[1] == pytest.approx(0.020, abs=0.002)


def first_token_of_a_disaggregated_request(model_dir: Path, handoff: HandoffCost) -> float:
    profile: Profile = constant_profile(model_dir, STEP_S).model_copy(update={"handoff": handoff})
    line = scenario_line("split", [], num_prefill=1, buckets=SPLIT)
    plan = [PlannedRequest(0, 0.0, 200, 4, "t")]
    simulation = PoolSimulation(
        parse_scenario(line),
        profile,
        Traffic(plan, seed=0, vocab_size=256, drain_timeout_s=60.0, horizon_s=None),
    )
    simulation.run()
    (record,) = simulation.records
    assert record.mode == "disaggregated" and record.sent_at is not None
    return record.chunk_times[0] - record.sent_at


def test_a_disaggregated_request_waits_the_hand_off_a_pool_measured(model_dir: Path) -> None:
    idle = HandoffCost(fixed_s=0.005)
    in_pool = idle.model_copy(update={"pool_s": 0.03})
    assert first_token_of_a_disaggregated_request(model_dir, idle) == pytest.approx(STEP_S + 0.005)
    assert first_token_of_a_disaggregated_request(model_dir, in_pool) == pytest.approx(
        STEP_S + 0.03
    )


def test_a_profile_without_the_pools_hand_off_loads_and_charges_the_idle_one() -> None:
    old = HandoffCost.model_validate({"fixed_s": 0.005, "per_byte_s": 1e-9})
    assert old.pool_s is None
    assert old.seconds(1000) == pytest.approx(0.005 + 1e-6)
    assert old.model_copy(update={"pool_s": 0.02}).seconds(1000) == pytest.approx(0.02 + 1e-6)
