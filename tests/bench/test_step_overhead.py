"""CPU time per engine step outside the model's forward, by phase, at 1, 16 and 64
decoding sequences on the tiny model (one torch thread): scheduling, building the
batch (block tables, slots, tensors), sampling, handing tokens to their requests,
accounting (progress, prefix-cache hashes) and the step-cost model. Run with
`make bench`. The phases are timed by wrapping the engine's own methods; "other" is
what remains of the step outside the forward and them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.config import EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.runner import ModelRunner
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BATCHES = (1, 16, 64)
STEPS = 50
PROMPT_TOKENS = 128
GOAL = 0.10  # of the step, outside the forward, at 64 sequences
FORWARD = "forward"


@contextmanager
def timed(spent: dict[str, float], targets: dict[str, tuple[Any, str]]) -> Iterator[None]:
    """Each (object, method) of `targets` adds its seconds to `spent` under its name."""
    originals = []
    for name, (owner, method) in targets.items():
        original: Callable[..., Any] = getattr(owner, method)
        originals.append((owner, method, original))
        setattr(owner, method, _timing(original, name, spent))
    try:
        yield
    finally:
        for owner, method, original in originals:
            setattr(owner, method, original)


def _timing(call: Callable[..., Any], name: str, spent: dict[str, float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

    return run


def decoding(engine: LLMEngine, batch: int) -> None:
    """`batch` sequences past their prefill, decoding."""
    params = SamplingParams(max_tokens=STEPS + 8, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    for index in range(batch):
        prompt = torch.randint(3, 4000, (PROMPT_TOKENS,), generator=generator).tolist()
        engine.add_request(f"overhead-{batch}-{index}", prompt, params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()


def profile(engine: LLMEngine, batch: int) -> dict[str, Any]:
    decoding(engine, batch)
    spent: dict[str, float] = {}
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # the model's own runner, not a simulated one
    phases = {
        FORWARD: (runner.model, "forward"),
        "scheduling": (engine.scheduler, "schedule"),
        "batch_building": (runner, "prepare"),
        "sampling": (runner.sampler, "sample"),
        "outputs": (engine, "_take_sampled"),
        "accounting": (engine, "_account"),
        "step_cost_model": (engine.step_cost, "update"),
    }
    with timed(spent, phases):
        started = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        total = time.perf_counter() - started
    while engine.has_unfinished():
        engine.step()
    outside = total - spent[FORWARD]
    per_step_ms = {name: 1e3 * seconds / STEPS for name, seconds in spent.items()}
    named = sum(ms for name, ms in per_step_ms.items() if name != FORWARD)
    return {
        "sequences": batch,
        "step_ms": 1e3 * total / STEPS,
        "forward_ms": per_step_ms.pop(FORWARD),
        "outside_share": outside / total,
        **{f"{name}_ms": ms for name, ms in per_step_ms.items()},
        "other_ms": 1e3 * outside / STEPS - named,
    }


def test_step_overhead(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    config = EngineConfig(
        model_dir=tiny_model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=2048)
    )
    engine = LLMEngine(config)
    rows = [profile(engine, batch) for batch in BATCHES]
    largest = rows[-1]
    costs = {
        k: v for k, v in largest.items() if k.endswith("_ms") and k not in ("step_ms", "forward_ms")
    }
    publish(
        "step_overhead",
        rows,
        {
            "model": "tiny (4 layers, hidden 256), 1 torch thread, greedy",
            "prompt_tokens": PROMPT_TOKENS,
            "steps": STEPS,
            "largest_costs_at_64": sorted(costs, key=lambda k: -costs[k])[:3],
            "goal": f"outside the forward < {GOAL:.0%} of the step at 64 sequences",
            "goal_met": largest["outside_share"] < GOAL,
        },
    )
    assert all(row["forward_ms"] > 0 for row in rows)
