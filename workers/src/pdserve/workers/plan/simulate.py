"""A scenario's simulation over a traffic on a profile: its figures, the mean of
several draws, timed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.plan import build_plan
from pdserve.workers.bench.prefix_workloads import prefix_figures
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.plan.costs import Profile
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.results import mean_of_draws, summarize_run
from pdserve.workers.plan.scenario import Scenario

# The simulations a prediction is the mean of. One draw of the steps' spread moves a
# tail percentile by several percent (a P99 rests on a handful of steps); the mean of
# five is steadier, at five times the simulation's cost (a small trace's plan stays
# well under its minute).
DRAWS = 5


def traffic_of(config: BenchConfig, model_dir: Path | str | None = None) -> Traffic:
    """The requests `pdserve bench` would send with `config`, prompts made as it makes
    them (text prompts tokenized with the tokenizer in `model_dir`)."""
    plan = build_plan(config)
    texts = any(planned.prefix is not None for planned in plan)
    tokenizer = Tokenizer.from_dir(model_dir) if texts and model_dir is not None else None
    return Traffic(
        plan, config.seed, config.vocab_size, config.drain_timeout_s, config.horizon_s,
        config.trace_length_scale, tokenizer,
    )  # fmt: skip


def simulate(
    scenario: Scenario, profile: Profile, traffic: Traffic, draws: int = DRAWS
) -> dict[str, Any]:
    """The scenario's figures, each the mean over `draws` simulations that draw the
    steps' spread (and the router's ties) with seeds of their own, with their spread
    across the draws (`results.mean_of_draws`); and the simulation's own cost:
    wall-clock seconds of all the draws, simulated seconds and engine steps of one."""
    runs = [simulate_draw(scenario, profile, traffic, draw) for draw in range(draws)]
    result = mean_of_draws(runs)
    result["draws"] = draws
    result["wall_s"] = sum(run["wall_s"] for run in runs)
    return result


def simulate_draw(
    scenario: Scenario, profile: Profile, traffic: Traffic, draw: int = 0
) -> dict[str, Any]:
    """The figures of one simulation, its spread drawn as draw `draw` draws it."""
    started = time.perf_counter()
    simulation = PoolSimulation(scenario, profile, traffic, draw)
    records = simulation.run()
    wall_s = time.perf_counter() - started
    summary = summarize_run(records, scenario.table.slo, scenario.percentiles, scenario.buckets)
    reuse = prefix_figures(records)
    return {
        "name": scenario.name,
        "workers": {role: len(scenario.urls(role)) for role in scenario.roles},
        "placement": scenario.placement,
        "wall_s": wall_s,
        "simulated_s": simulation.events.now,
        "steps": simulation.steps,
        "handoff_failures": simulation.handoff_failures,
        "handoffs_skipped": simulation.handoffs_skipped,
        "prefix_cache": None
        if reuse is None
        else {
            "prompt_tokens": reuse.prompt_tokens,
            "cached_tokens": reuse.cached_tokens,
            "hit_rate": reuse.hit_rate,
        },
        **summary,
    }
