"""`pdserve profile` on the small model: the engine's steps over the designed sweep,
the fit and its error written with the model, device and versions, workers timed
stepping together on the machine's cores, and a file the simulator runs a pool on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.base.process import pdserve_command
from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.plan.contention import levels
from pdserve.workers.plan.costs import load_profile
from pdserve.workers.plan.fit import timed_errors, typical_pace
from pdserve.workers.plan.scenario import parse_scenario
from pdserve.workers.plan.simulate import simulate, traffic_of
from support.plan import scenario_line


def test_profile_sweeps_the_engine_and_the_simulator_runs_on_it(
    small_model_dir: Path, tmp_path: Path
) -> None:
    output = tmp_path / "profile.json"
    command = pdserve_command(
        "profile", "--model", str(small_model_dir), "-o", str(output),
        "--sweep", "quick", "--no-handoff",
    )  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "step-time fit error" in run.stdout

    profile = load_profile(output)
    assert profile.model_json == json.loads((small_model_dir / "config.json").read_text())
    assert profile.device == "cpu"
    assert profile.versions["torch"] == torch.__version__
    steps = profile.steps
    assert profile.step_fit.samples == len(steps) > 0
    assert profile.step_fit.holdout_samples > 0
    # The sweep excites each term on its own: decode-only and prefill-only steps,
    # several decode contexts, chunks starting at several offsets.
    assert any(s.prefill_tokens == 0 and s.decode_tokens > 0 for s in steps)
    assert any(s.decode_tokens == 0 and s.prefill_tokens > 0 for s in steps)
    assert len({s.decode_keys // max(1, s.decode_tokens) for s in steps if s.decode_tokens}) > 2
    assert len({s.prefill_keys for s in steps if s.prefill_tokens}) > 1
    # The error written is the fit's against the steps as timed, at each step's own
    # pace where the fit took the machine's pace into account.
    pace = typical_pace(steps) if profile.step_fit.paced else None
    errors = timed_errors(profile.step_cost, steps, pace)
    assert float(np.mean(errors)) == pytest.approx(profile.step_fit.mean_abs)
    # The machine the workers share: its cores, a worker's threads, and workers timed
    # alone and together up to one more than the cores hold.
    assert profile.cores == len(os.sched_getaffinity(0))
    assert profile.threads == 1  # a worker's default on a CPU
    together = [count for count, _ in profile.contention.samples]
    assert together == list(levels(profile.cores, profile.threads))
    assert profile.contention.samples[0] == (1, 1.0)
    # Each level's steps spread around their typical time: the typical step at 1.
    assert [level for level, _ in profile.contention.spreads] == together
    for _, spread in profile.contention.spreads:
        assert spread.samples > 0
        assert spread.quantiles[0] <= 1.0 <= spread.quantiles[-1]

    # Simulated time costs next to nothing: a drain long enough for a profile taken on
    # the slowest machine lets every request finish, whatever the steps cost.
    config = BenchConfig(
        url="simulated", workload="chat", rate=4.0, duration_s=5.0, drain_timeout_s=1e6
    )
    traffic = traffic_of(config)
    result = simulate(parse_scenario(scenario_line("one", [])), profile, traffic)
    assert result["requests"] == len(traffic.plan) > 0
    assert result["succeeded"] == result["requests"]
