"""A step that carries a prompt's chunk computes slower in a serving worker than the
engine alone in the sweep: the profile measures it as the streams' gap over the step
that carried a prompt sent while they decode, and the simulator charges such steps
the measured factor (decode-only steps keep the step-cost model's time)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import Profile, ServingOverhead, StepCost
from pdserve.workers.plan.pair import mixed_gap
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from support.plan import constant_profile, model_config_dir, scenario_line

STEP_S = 0.01


def test_the_prompts_step_is_each_streams_longest_gap_in_its_window() -> None:
    # Decode steps every 10 ms; the prompt, sent at 0.025, shares the step 0.03-0.06.
    first = [0.0, 0.01, 0.02, 0.03, 0.06, 0.07]
    second = [0.001, 0.011, 0.021, 0.031, 0.063, 0.071]
    assert mixed_gap([first, second], 0.025, 0.064) == pytest.approx(0.031)
    # A stream whose event of that step comes after the window sees none there.
    assert mixed_gap([first], 0.065, 0.069) is None
    # No gap spans the start of a stream's next request (NaN marks it).
    restarted = [0.0, 0.01, math.nan, 0.08, 0.09]
    assert mixed_gap([restarted], 0.02, 0.085) is None


def test_only_steps_carrying_a_prompts_chunk_take_the_mixed_factor() -> None:
    cost = StepCost(
        base_s=0.004, per_decode_token_s=1e-4, per_prefill_token_s=5e-5,
        per_decode_key_s=0.0, per_prefill_key_s=0.0,
    )  # fmt: skip
    serving = ServingOverhead(mixed_factor=1.5)
    decode_only = StepFeatures(4, 0, 400, 0)
    mixed = StepFeatures(4, 128, 400, 128 * 128)
    assert serving.compute(decode_only, cost) == cost.seconds(decode_only)
    assert serving.compute(mixed, cost) == pytest.approx(1.5 * cost.seconds(mixed))
    assert ServingOverhead().compute(mixed, cost) == cost.seconds(mixed)  # not measured


def test_the_simulator_charges_the_prompts_step_the_factor(tmp_path: Path) -> None:
    plain = constant_profile(model_config_dir(tmp_path), STEP_S)
    slower = plain.model_copy(update={"serving": ServingOverhead(mixed_factor=1.8)})

    def token_times(profile: Profile) -> list[float]:
        line = scenario_line("mixed", ["--max-num-batched-tokens", "64"])
        plan = [PlannedRequest(0, 0.0, 16, 20, "t")]
        simulation = PoolSimulation(
            parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None)
        )
        (record,) = simulation.run()
        return record.chunk_times

    before, after = token_times(plain), token_times(slower)
    # The prompt's step takes 1.8 times as long; every decode step after it does not.
    assert after[0] - before[0] == pytest.approx(0.8 * STEP_S)
    assert np.diff(after) == pytest.approx(np.diff(before))
