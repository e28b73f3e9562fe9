"""The Mooncake comparison of `test_kv_routing` simulated over many samples of the
replay, in a few minutes: what one measured run of it is drawn from.

The same pool (one prefill and two decode workers with the bench's flags and cache
sizes, prompts of more than BOUNDARY uncached tokens disaggregated), the same replay
(the Mooncake synthetic trace at the bench's scales, rate and length), the same
routers (the single worker holding both decode workers' cache, load-only, KV-aware),
each replayed by `pdserve simulate`'s pool: the engines' own schedulers and prefix
caches and the router's own scoring, on a simulated clock, at the step costs of a
profile of this machine, every worker on this machine's cores as the measured run has
them (placement one-host). The bench's seed draws which of the trace's prefix groups the
replay takes; SAMPLES seeds from the bench's own (0) on, each simulated DRAWS times
(each draw its own draw of the steps' spread and of the router's ties).

A measured run's TTFT P50 ratio rests on the few requests around the median (on the
90-request replay it falls between the hits, tens of milliseconds, and the misses,
hundreds), and its cached tokens on where a few long prefixes were placed and evicted,
so one run shows one draw. This shows how often KV-aware routing's targets (TTFT P50
at least GOAL_RATIO times load-only's, at least GOAL_FOUND of the prompt tokens the
single worker finds cached) hold over draws and samples, and is quick enough to weigh a
change of the routing or the hand-off by. Its TTFTs leave out the router's and the
HTTP path's own time; its cached tokens are the engines' own count, as measured.

The profile: PDSERVE_BENCH_PROFILE if set (a `pdserve profile` file of this model, e.g.
the one `test_plan_accuracy` writes), else the full sweep profiled here first (about
three minutes; the quick one's few long prompts left the attention term of prefill
chunks at 0 in one run here, which made a 9,000-token prompt seconds cheaper than it
is and every TTFT of the replay a fraction of the measured ones). Run with `make bench
PYTEST_ARGS='-k kv_routing_simulated'`; PDSERVE_BENCH_KV_SIM_SAMPLES and
PDSERVE_BENCH_KV_SIM_DRAWS set the counts, and the replay follows the bench's
PDSERVE_BENCH_KV_* settings.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from bench import test_kv_routing as measured

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.plan.costs import Profile, load_profile, write_profile
from pdserve.workers.plan.pool import Traffic
from pdserve.workers.plan.profile import ProfileRun, profile_model
from pdserve.workers.plan.scenario import Scenario, parse_scenario
from pdserve.workers.plan.simulate import simulate_draw, traffic_of
from support.results import RESULTS_DIR, publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SAMPLES = int(os.environ.get("PDSERVE_BENCH_KV_SIM_SAMPLES", "8"))
DRAWS = int(os.environ.get("PDSERVE_BENCH_KV_SIM_DRAWS", "5"))
PROFILE = os.environ.get("PDSERVE_BENCH_PROFILE")
REFERENCE, LOAD, KV = "single worker", "load", "kv-aware"
GOAL_RATIO = 2.0
GOAL_FOUND = 0.95
# A sample whose single worker finds fewer of its prompt tokens cached than this has
# next to nothing to route by: reported, not judged.
MIN_REUSE = 0.05


def test_kv_routing_simulated(tiny_model_dir: Path) -> None:
    if not measured.TRACE.is_file():
        pytest.skip(f"no trace at {measured.TRACE}")
    profile = machine_profile(tiny_model_dir)
    replay = measured.workloads("http://simulated", measured.PD_SLOWER)["mooncake"]
    scenarios = {router: scenario(router, tiny_model_dir) for router in (REFERENCE, LOAD, KV)}
    started = time.perf_counter()
    rows = []
    for sample in range(SAMPLES):
        traffic = traffic_of(replace(replay, seed=replay.seed + sample), tiny_model_dir)
        runs = {router: draws(s, profile, traffic) for router, s in scenarios.items()}
        rows.append(sample_row(replay.seed + sample, runs))
    judged = [row for row in rows if row["judged"]]
    per_draw = {
        row["seed"]: {"ratios": row.pop("ratios"), "found": row.pop("found")} for row in rows
    }
    publish(
        "kv_routing_simulated",
        rows,
        {
            "replay": describe(replay),
            "samples, draws": f"{SAMPLES}, {DRAWS}",
            "profile": PROFILE or "full sweep, profiled here",
            "samples judged": len(judged),
            **goals_met([per_draw[row["seed"]] for row in judged]),
            "per draw, by seed": per_draw,
            "wall_s": round(time.perf_counter() - started, 1),
        },
    )
    assert judged, "no sample of the replay shares prefixes"


def machine_profile(model_dir: Path) -> Profile:
    """The profile the simulations price steps with (see the module's docstring)."""
    if PROFILE:
        return load_profile(Path(PROFILE))
    profile = profile_model(ProfileRun(model_dir, sweep="full"))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    write_profile(profile, RESULTS_DIR / "kv_routing_simulated_profile.json")
    return profile


def scenario(router: str, model_dir: Path) -> Scenario:
    """The bench's pool for `router`, as the simulator reads it: the single worker is
    one decode worker with both caches, every request colocated on it."""
    reference = router == REFERENCE
    blocks = measured.cache_blocks("mooncake", router)
    buckets: list[dict[str, Any]] = [{"mode": "colocated"}]
    if not reference:
        buckets = [
            {"maxInputTokens": measured.BOUNDARY, "mode": "colocated"},
            {"mode": "disaggregated"},
        ]
    routing: dict[str, Any] = {
        "pool": "simulated",
        "model": {"name": "tiny", "path": str(model_dir)},
        "buckets": buckets,
        "routingPolicy": {"type": LOAD if reference else router, "blockSize": measured.BLOCK},
        "discovery": {
            "kind": "static",
            "decode": [f"http://decode-{i}.sim:8000" for i in range(1 if reference else 2)],
            "prefill": ["http://prefill-0.sim:8000"],
        },
    }
    if measured.SLO_TARGETS.ttft_ms is not None:  # goodput as the measured run counts it
        routing["slo"] = {"ttftSeconds": measured.SLO_TARGETS.ttft_ms / 1000}
    prefill = ["--model", str(model_dir), "--role", "prefill"]
    workers = {
        "decode": ["--model", str(model_dir), *measured.worker_args(blocks)],
        "prefill": [*prefill, *measured.worker_args(measured.cache_blocks("mooncake"))],
    }
    return parse_scenario(
        json.dumps(
            {"name": router, "routing": routing, "workers": workers, "placement": "one-host"}
        )
    )


def draws(scenario: Scenario, profile: Profile, traffic: Traffic) -> list[dict[str, Any]]:
    """DRAWS simulations of `scenario` over `traffic`."""
    return [simulate_draw(scenario, profile, traffic, draw) for draw in range(DRAWS)]


def sample_row(seed: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One sample's figures: each router's cached tokens and TTFT P50 and P99 (means
    over the draws), and per draw the P50 ratio of load-only over KV-aware and the
    share of the single worker's cached tokens KV-aware found."""
    cached = {
        router: [run["prefix_cache"]["cached_tokens"] for run in r] for router, r in runs.items()
    }
    p50, p99 = (
        {router: [run["overall"]["ttft_s"][q] * 1e3 for run in r] for router, r in runs.items()}
        for q in ("p50", "p99")
    )
    reusable = statistics.mean(cached[REFERENCE])
    prompt_tokens = runs[REFERENCE][0]["prefix_cache"]["prompt_tokens"]
    ratios = [load / kv for load, kv in zip(p50[LOAD], p50[KV], strict=True) if kv > 0]
    found = [tokens / reusable for tokens in cached[KV]] if reusable else []
    return {
        "seed": seed,
        "reusable_share": round(reusable / prompt_tokens, 3) if prompt_tokens else 0.0,
        "judged": bool(prompt_tokens) and reusable / prompt_tokens >= MIN_REUSE,
        "cached_single_load_kv": "/".join(f"{statistics.mean(cached[r]):.0f}" for r in runs),
        "ttft_p50_ms_single_load_kv": "/".join(f"{statistics.mean(p50[r]):.1f}" for r in runs),
        "ttft_p99_s_single_load_kv": "/".join(f"{statistics.mean(p99[r]) / 1e3:.2f}" for r in runs),
        "p50_ratio_min_median_max": spread(ratios),
        "found_min_median_max": spread(found),
        "draws_ratio_met": sum(ratio >= GOAL_RATIO for ratio in ratios),
        "draws_found_met": sum(share >= GOAL_FOUND for share in found),
        # Prompts past the model's positions, and requests the drain gave up on.
        "failed_single_load_kv": "/".join(
            f"{statistics.mean(run['failed'] for run in r):.1f}" for r in runs.values()
        ),
        "ratios": ratios,
        "found": found,
    }


def goals_met(samples: Sequence[dict[str, list[float]]]) -> dict[str, Any]:
    """How often each goal held, over the draws of `samples` (each sample's P50 ratios
    and shares found, per draw)."""
    ratios = [ratio for sample in samples for ratio in sample["ratios"]]
    found = [share for sample in samples for share in sample["found"]]
    return {
        "p50 ratio over all draws, min/median/max": spread(ratios),
        f"draws with the p50 ratio at least {GOAL_RATIO:g}": met(ratios, GOAL_RATIO),
        "found of the single worker's, min/median/max": spread(found),
        f"draws finding at least {GOAL_FOUND:g}": met(found, GOAL_FOUND),
    }


def met(values: Sequence[float], goal: float) -> str:
    """How many of `values` reach `goal`, of how many."""
    return f"{sum(value >= goal for value in values)}/{len(values)}"


def spread(values: Sequence[float]) -> str:
    """min/median/max, or - when there are none."""
    if not values:
        return "-"
    return f"{min(values):.2f}/{statistics.median(values):.2f}/{max(values):.2f}"


def describe(config: BenchConfig) -> str:
    """The replay's settings, as the bench takes them."""
    return (
        f"{config.num_requests} requests, prefix share {config.trace_prefix_share}, "
        f"time scale {config.trace_time_scale:g}, length scale {config.trace_length_scale:g}"
    )
