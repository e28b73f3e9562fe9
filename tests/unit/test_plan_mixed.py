"""A step that carries a prompt's chunk computes slower in a serving worker than the
engine alone in the sweep: the profile measures it from a worker's step log while
prompts are sent to it as streams decode, and the simulator charges such steps the
measured factor (decode-only steps keep the step-cost model's time)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import Profile, ServingOverhead, StepCost
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from pdserve.workers.plan.step_log import (
    STEP_LOGGERS,
    prompt_step_samples,
    read_steps,
    step_logging_env,
)
from support.engine import make_engine, run_to_completion
from support.plan import constant_profile, model_config_dir, scenario_line

STEP_S = 0.01


LOG = """\
DEBUG pdserve.workers.engine.steps: step warm-up-0@0+64
DEBUG pdserve.workers.engine.step_timing: tokens=64 took=9.0ms
DEBUG pdserve.workers.engine.steps: step a@40+1 b@40+1
DEBUG pdserve.workers.engine.step_timing: tokens=2 took=6.0ms
INFO pdserve.workers.server: something else
DEBUG pdserve.workers.engine.steps: step a@41+1 b@41+1 req-7@0+128
DEBUG pdserve.workers.engine.step_timing: tokens=130 took=21.0ms
DEBUG pdserve.workers.engine.steps: step a@42+1 b@42+1 c@0+32
DEBUG pdserve.workers.engine.step_timing: tokens=34 took=8.0ms
DEBUG pdserve.workers.engine.steps: step a@43+1 b@43+1
DEBUG pdserve.workers.engine.step_timing: tokens=2 took=6.0ms
"""
LINEAR = StepCost(
    base_s=0.004, per_decode_token_s=5e-4, per_prefill_token_s=1e-4,
    per_decode_key_s=0.0, per_prefill_key_s=0.0,
)  # fmt: skip


def test_a_workers_step_log_reads_as_its_steps() -> None:
    steps = read_steps(LOG)
    # The warm-up step is left out, and so is a timing line cut from its chunks.
    assert [step.took_s for step in steps] == pytest.approx([0.006, 0.021, 0.008, 0.006])
    assert steps[1].features == StepFeatures(2, 128, 2 * 42, 128 * 128)
    assert [step.longest_chunk for step in steps] == [1, 128, 32, 1]
    assert read_steps(LOG[LOG.index("took=9.0ms") :]) == steps


def test_a_prompt_steps_sample_is_what_it_took_beyond_every_steps_overhead() -> None:
    # Decode-only steps take 1 ms beyond the model (5 ms); the 128-token prompt's step
    # takes 21 ms against the model's 4 + 1 + 12.8 = 17.8 ms: 20 ms of compute.
    (sample,) = prompt_step_samples(read_steps(LOG), LINEAR, least_chunk=64)
    assert sample == pytest.approx((128, 0.020 / 0.0178))
    # With no decode-only step to tell the overhead, a step's whole time is compute.
    (alone,) = prompt_step_samples(read_steps(LOG)[1:3], LINEAR, least_chunk=64)
    assert alone == pytest.approx((128, 0.021 / 0.0178))
    # The streams' own shorter prompts are samples only if asked for.
    assert len(prompt_step_samples(read_steps(LOG), LINEAR, least_chunk=32)) == 2
    # A slice of a longer log is given the overhead all of it tells (a slice's few
    # decode-only steps would tell it less surely): here 3 ms, 18 ms of compute.
    (sliced,) = prompt_step_samples(read_steps(LOG)[1:3], LINEAR, 64, every_step_s=0.003)
    assert sliced == pytest.approx((128, 0.018 / 0.0178))


def test_the_step_logging_module_turns_on_only_the_step_loggers(tmp_path: Path) -> None:
    env = step_logging_env(tmp_path)
    code = (
        "import logging; "
        f"print([logging.getLogger(n).level for n in {STEP_LOGGERS!r}], "
        "logging.getLogger('pdserve').level)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert ran.stdout.strip() == f"[{logging.DEBUG}, {logging.DEBUG}] {logging.NOTSET}"


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


def test_an_engines_own_step_log_reads_as_the_steps_it_ran(
    small_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lines the profile reads are the ones the engine writes: a short prompt's
    step, then a long prompt chunked under a 64-token budget beside its decode."""
    engine = make_engine(small_model_dir, budget=64)
    with caplog.at_level(logging.DEBUG, logger="pdserve.workers.engine"):
        _, ran = run_to_completion(engine, [list(range(3, 19)), list(range(3, 99))])
    # As a worker's log writes them (`pdserve worker`'s format ends in "name: message").
    steps = read_steps("\n".join(f"{r.name}: {r.getMessage()}" for r in caplog.records))
    assert [step.features for step in steps] == [StepFeatures.of(r.chunks) for r in ran]
    assert [step.longest_chunk for step in steps][:2] == [16, 63]
    assert all(step.took_s > 0 for step in steps)
