"""The simulator's predictions against measurement on this machine: the tiny model is
profiled here (`pdserve profile`: the full sweep and a worker pair), then one pool (the
demo's: one prefill and one decode worker) serves a slice of the Azure conversation
trace, scaled to this machine, routed three ways (colocated, bucketed,
disaggregated) at two rates, and the simulator replays the same traffic on the same
pool's configuration. Per run: measured and predicted TTFT P50/P99, ITL P99 and
goodput, the error of each, whether the ranking of the routings agrees, and the
simulator's speed. Run with `make bench`."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.demo import BUCKET_BOUNDARY, demo_pool
from pdserve.operator import api
from pdserve.operator.planning.candidates import Candidate
from pdserve.operator.planning.simulator import scenario_line
from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.metrics import SLO
from pdserve.workers.bench.runner import run_benchmark
from pdserve.workers.bench.trace import load_trace
from pdserve.workers.engine.config import ModelConfig
from pdserve.workers.plan.costs import write_profile
from pdserve.workers.plan.profile import ProfileRun, profile_model
from pdserve.workers.plan.scenario import parse_scenario
from pdserve.workers.plan.simulate import simulate, traffic_of
from support.results import RESULTS_DIR, publish
from support.router import local_pool, router_metric, worker_load
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_conv.csv"
START_S = 600.0  # past the trace's sparse first minutes
SECONDS = 60.0  # of arrivals per run
LENGTH_SCALE = 0.25
MAX_OUTPUT_TOKENS = 128
RATES = {"slow": 6.0, "fast": 3.0}  # trace seconds stretched by these factors
SLO_TARGETS = SLO(ttft_ms=2000.0, itl_ms=200.0)
ROUTINGS: dict[str, list[dict[str, Any]]] = {
    "colocated": [{"mode": "colocated"}],
    "bucketed": [
        {"maxInputTokens": BUCKET_BOUNDARY, "mode": "colocated"},
        {"mode": "disaggregated"},
    ],
    "disaggregated": [{"mode": "disaggregated"}],
}


def scaled_trace(out: Path, time_scale: float) -> Path:
    """A slice of the trace, stretched in time and shrunk in length for this machine."""
    if not TRACE.is_file():
        pytest.skip(f"no trace at {TRACE}")
    start = datetime(2023, 11, 16, 18, 0, 0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for row in load_trace(TRACE):
        offset = (row.offset_s - START_S) * time_scale
        if offset < 0:
            continue
        if offset >= SECONDS:
            break
        context = max(1, round(row.context_tokens * LENGTH_SCALE))
        generated = max(1, round(row.generated_tokens * LENGTH_SCALE))
        lines.append(f"{start + timedelta(seconds=offset)},{context},{generated}")
    out.write_text("\n".join(lines) + "\n")
    return out


def use_buckets(local: Any, buckets: list[dict[str, Any]]) -> None:
    """Switch the router's table and wait until it is in force."""
    table = json.loads(local.routing_file.read_text())
    if table["buckets"] == buckets:
        return
    before = router_metric(local, "pdserve_router_config_reloads_total", result="applied")
    table["buckets"] = buckets
    local.routing_file.write_text(json.dumps(table))
    wait_until(
        lambda: router_metric(local, "pdserve_router_config_reloads_total", result="applied")
        > before,
        30, "the routing table to switch",
    )  # fmt: skip


def figures(metrics: Any) -> dict[str, float | None]:
    """TTFT P50/P99, ITL P99 (ms) and goodput of a run."""
    overall = metrics.overall
    ms = lambda d, q: None if d is None else getattr(d, q) * 1000  # noqa: E731
    return {
        "ttft_p50_ms": ms(overall.ttft, "p50"),
        "ttft_p99_ms": ms(overall.ttft, "p99"),
        "itl_p99_ms": ms(overall.itl, "p99"),
        "goodput": overall.goodput,
    }


def predicted(result: dict[str, Any]) -> dict[str, float | None]:
    overall = result["overall"]
    return {
        "ttft_p50_ms": overall["ttft_s"]["p50"] * 1000,
        "ttft_p99_ms": overall["ttft_s"]["p99"] * 1000,
        "itl_p99_ms": overall["itl_s"]["p99"] * 1000,
        "goodput": result["goodput"],
    }


def error(measured: float | None, guess: float | None) -> float | None:
    if measured is None or guess is None or measured == 0:
        return None
    return (guess - measured) / measured * 100


def test_simulated_against_measured_on_the_azure_trace(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = demo_pool(tiny_model_dir)
    manifest["spec"]["slo"] = {"ttft": {"seconds": 2.0}, "itl": {"seconds": 0.2}}
    pool = api.parse_pool(manifest)
    profile = profile_model(
        ProfileRun(tiny_model_dir, "full", True, "nixl", ("--dtype", "float32"))
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    write_profile(profile, RESULTS_DIR / "plan_profile.json")
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    rows: list[dict[str, Any]] = []
    speeds: list[float] = []
    with local_pool(pool, tmp_path / "pool") as local:
        workers = local.workers["prefill"] + local.workers["decode"]
        for rate, time_scale in RATES.items():
            trace = scaled_trace(tmp_path / f"trace-{rate}.csv", time_scale)
            for seed, (routing, buckets) in enumerate(ROUTINGS.items()):
                use_buckets(local, buckets)
                config = BenchConfig(
                    url=local.url, trace=trace, seed=seed, slo=SLO_TARGETS, vocab_size=vocab,
                    max_output_tokens=MAX_OUTPUT_TOKENS, drain_timeout_s=300.0,
                )  # fmt: skip
                measured = run_benchmark(config)
                wait_until(
                    lambda: all(worker_load(w.url)["in_flight"] == 0 for w in workers),
                    120, "the workers to drain",
                )  # fmt: skip
                spec = api.parse_spec({**api.dump(pool.spec), "routing": {"buckets": buckets}})
                candidate = Candidate("bucketed", 1, 1, "", None, spec)
                line = scenario_line(pool.metadata.name, candidate, (50, 99), (BUCKET_BOUNDARY,))
                result = simulate(parse_scenario(line), profile, traffic_of(config))
                speeds.append(result["simulated_s"] / result["wall_s"])
                real, guess = figures(measured.metrics), predicted(result)
                row: dict[str, Any] = {"rate": rate, "routing": routing}
                for key in real:
                    row[f"{key} measured"] = real[key]
                    row[f"{key} predicted"] = guess[key]
                    row[f"{key} error %"] = error(real[key], guess[key])
                rows.append(row)
    ranking = {}
    for rate in RATES:
        mine = [r for r in rows if r["rate"] == rate]
        by_real = sorted(mine, key=lambda r: r["ttft_p99_ms measured"])
        by_guess = sorted(mine, key=lambda r: r["ttft_p99_ms predicted"])
        ranking[rate] = [r["routing"] for r in by_real] == [r["routing"] for r in by_guess]
    publish(
        "plan_accuracy", rows,
        {"trace": str(TRACE), "from_s": START_S, "seconds_of_arrivals": SECONDS,
         "time_scales": RATES, "length_scale": LENGTH_SCALE,
         "step_fit": profile.step_fit.model_dump(), "handoff": profile.handoff.model_dump(),
         "request_overhead_s": profile.request_overhead_s,
         "ranking_by_ttft_p99_agrees": ranking,
         "simulated_seconds_per_wall_second": speeds},
    )  # fmt: skip
