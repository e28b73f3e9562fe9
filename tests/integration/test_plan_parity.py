"""The simulator runs the engine's own scheduling: for a fixed list of arrivals, a
simulated worker computes exactly the chunks, in exactly the order, that the real
engine computes (as the engine's step log shows both), preemptions included.

The budget is static: an adaptive budget reads the clock, which a real engine's steps
move by however long the machine took."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.bench.plan import PlannedRequest, prompt_tokens
from pdserve.workers.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from support.plan import constant_profile, scenario_line

STEP_S = 0.01
SEED, VOCAB = 7, 256
# (engine step before which the request arrives, prompt tokens, output tokens): long
# prompts chunked under the budget, decodes joining mid-prefill, and more KV than the
# cache holds, so that requests are preempted and computed again.
ARRIVALS = [
    (0, 40, 12),
    (0, 300, 6),
    (2, 120, 20),
    (3, 17, 30),
    (5, 260, 8),
    (6, 64, 25),
    (9, 33, 40),
    (14, 200, 10),
]
FLAGS = ["--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--num-kv-blocks", "24"]


def engine_config(model_dir: Path) -> EngineConfig:
    """The engine the worker flags above describe."""
    return EngineConfig(
        model_dir=model_dir,
        cache=CacheConfig(num_blocks=24),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
    )


def logged_steps(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pdserve.workers.engine.steps"]


def run_real(model_dir: Path) -> None:
    """The real engine, a request added before the step its arrival names."""
    engine = LLMEngine(engine_config(model_dir))
    step = 0
    pending = list(enumerate(ARRIVALS))
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            index, (_, prompt_len, output_len) = pending.pop(0)
            prompt = prompt_tokens(SEED, index, prompt_len, VOCAB)
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(f"req-{index}", prompt, params)
        assert engine.has_unfinished(), "the arrivals leave the engine idle"
        engine.step()
        step += 1


def run_simulated(model_dir: Path) -> PoolSimulation:
    """The simulator: each request arrives while the step before its own runs (steps
    take STEP_S), through the router, to one worker run by the pool's flags."""
    plan = [
        PlannedRequest(i, max(0.0, (step - 0.5) * STEP_S), prompt_len, output_len, "parity")
        for i, (step, prompt_len, output_len) in enumerate(ARRIVALS)
    ]
    scenario = parse_scenario(scenario_line("parity", FLAGS))
    traffic = Traffic(plan, SEED, VOCAB, drain_timeout_s=60.0, horizon_s=None)
    simulation = PoolSimulation(scenario, constant_profile(model_dir, STEP_S), traffic)
    records = simulation.run()
    assert all(record.finished for record in records)
    return simulation


def test_simulated_steps_are_the_engines_steps(
    small_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pdserve.workers.engine.steps")
    run_real(small_model_dir)
    real = logged_steps(caplog)
    caplog.clear()
    simulation = run_simulated(small_model_dir)
    simulated = logged_steps(caplog)

    assert simulated == real
    worker = next(iter(simulation.workers.values()))
    assert worker.engine.scheduler.num_preemptions > 0, "the arrivals were meant to preempt"
    last_token = max(record.ended_at or 0.0 for record in simulation.records)
    assert last_token == pytest.approx(len(real) * STEP_S)
