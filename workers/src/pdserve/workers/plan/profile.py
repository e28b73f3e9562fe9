"""`pdserve profile`: measure a model on this machine and write the profile file."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import torch

from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.runner import resolve_kv_dtype
from pdserve.workers.plan.contention import measure_contention
from pdserve.workers.plan.costs import Profile, Spread, StepCost
from pdserve.workers.plan.fit import fit_with_error, round_costs
from pdserve.workers.plan.pair import PairSetup, measure_pair
from pdserve.workers.plan.scenario import role_setup
from pdserve.workers.plan.sweep import DESIGNS, Sweep, worker_threads

# Prompt lengths the hand-off is measured at (those the model's context allows).
HANDOFF_LENGTHS = (16, 128, 512, 1536)


@dataclass(frozen=True)
class ProfileRun:
    """What to profile, and how."""

    model: Path
    sweep: str = "full"
    handoff: bool = True
    kv_transfer: str = "nixl"
    worker_args: tuple[str, ...] = ()
    contention: bool = True  # time workers stepping together on this machine's cores


def profile_model(run: ProfileRun, progress: Callable[[str], None] = lambda line: None) -> Profile:
    """Sweep the engine's steps, fit the step cost, and (unless told not to) time
    workers stepping together and measure a worker pair."""
    setup = role_setup("profile", ["--model", str(run.model), *run.worker_args])
    engine = LLMEngine(setup.engine)
    with worker_threads(setup) as threads:
        measured = Sweep(engine).run(DESIGNS[run.sweep], progress)
    cost, fit = fit_with_error(measured)
    spreads = cost_spreads(round_costs(measured, fit.paced))
    cores = machine_cores()
    profile = Profile(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        model=str(run.model.resolve()),
        model_json=json.loads((run.model / "config.json").read_text()),
        device=setup.engine.device,
        device_name=_device_name(setup.engine.device),
        threads=threads,
        cores=cores,
        versions=_versions(),
        engine_args=run.worker_args,
        step_cost=cost,
        step_fit=fit,
        steps=tuple(sample for _, sample in measured),
    )
    if run.contention:
        contention, levels = measure_contention(
            run.model, run.worker_args, cores, threads, DESIGNS[run.sweep].together_s, progress
        )
        spreads.update(levels)
        profile = profile.model_copy(update={"contention": contention})
    profile = profile.model_copy(update={"spreads": dict(spreads)})
    if not run.handoff:
        return profile
    itemsize = resolve_kv_dtype(setup.engine, engine.model_config).itemsize
    model = engine.model_config
    pair = PairSetup(
        model=run.model,
        worker_args=run.worker_args,
        backend=run.kv_transfer,
        lengths=tuple(n for n in HANDOFF_LENGTHS if n < engine.max_model_len),
        block_bytes=2
        * model.num_layers
        * model.num_kv_heads
        * model.head_dim
        * itemsize
        * engine.block_size,
        block_size=engine.block_size,
        vocab=model.vocab_size,
    )
    del engine  # the pair's workers need the memory and the cores
    figures = measure_pair(pair, cost, progress)
    return profile.model_copy(
        update={
            "handoff": figures.handoff,
            "request_overhead_s": figures.request_overhead_s,
            "busy_request_overhead_s": figures.busy_request_overhead_s,
            "serving": figures.serving,
            "startup_s": figures.startup_s,
            "clients": figures.clients,
            "contention": profile.contention.model_copy(
                update={
                    "pool": figures.pool,
                    "pool_prompt": figures.pool_prompt,
                    "pool_prompt_over_model": figures.pool_prompt_over_model,
                }
            ),
            "spreads": {**spreads, **figures.spreads},
        }
    )


def cost_spreads(costs: Sequence[StepCost]) -> dict[str, Spread]:
    """Each step cost's value in each round's fit, by its name in the file."""
    return {
        f"step_cost.{name}": Spread(rounds=tuple(getattr(cost, name) for cost in costs))
        for name in StepCost.model_fields
    }


def machine_cores() -> int:
    """The cores this process may run on (those its workers share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for package in ("pdserve-workers", "pdserve"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions
