"""The simulator's predictions against measurement on this machine, in three parts
that each take under fifteen minutes, so that each can run while the machine is quiet:

- `test_profile_this_machine`: the tiny model profiled here (`pdserve profile`: the
  full sweep, workers stepping together, a worker pair and a router in front of it),
  written to out/bench/plan_profile.json;
- `test_measure_a_workload[azure|mooncake]`: one pool (the demo's: one prefill and
  one decode worker, KV-aware routing) serves a slice of the Azure conversation trace
  or of the Mooncake synthetic trace (prefixes shared as the trace says), scaled to
  this machine, routed three ways (colocated, bucketed, disaggregated) at two rates;
  the measured figures go to out/bench/plan_measured_<workload>.json;
- `test_predicted_against_measured`: the simulator replays each run's traffic on the
  same pool's configuration with that profile, every process on this machine's cores
  as they ran (placement one-host). Per run: measured and predicted TTFT
  P50/P99, ITL P99, goodput and prefix-cache hit rate, the error of each, whether the
  ranking of the routings agrees, and the simulator's speed.

Run with `make bench`, or a part at a time with -k."""

from __future__ import annotations

import json
import os
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
from pdserve.workers.bench.prefix_workloads import prefix_figures
from pdserve.workers.bench.runner import run_benchmark
from pdserve.workers.bench.trace import load_trace
from pdserve.workers.engine.config import ModelConfig
from pdserve.workers.plan.costs import Profile, load_profile, write_profile
from pdserve.workers.plan.profile import ProfileRun, profile_model
from pdserve.workers.plan.scenario import parse_scenario
from pdserve.workers.plan.simulate import simulate, traffic_of
from support.results import RESULTS_DIR, publish
from support.router import local_pool, router_metric, worker_load
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
TRACE = TRACES / "azure_llm_2023_conv.csv"
MOONCAKE = TRACES / "mooncake_synthetic.jsonl"
START_S = 600.0  # past the trace's sparse first minutes
SECONDS = 30.0  # of arrivals per run
LENGTH_SCALE = 0.25
MAX_OUTPUT_TOKENS = 128
RATES = {"slow": 6.0, "fast": 3.0}  # trace seconds stretched by these factors
# The Mooncake trace: its first requests, blocks of 512 tokens scaled to 32.
MOONCAKE_REQUESTS = 30
MOONCAKE_LENGTH_SCALE = 1 / 16
MOONCAKE_MAX_OUTPUT_TOKENS = 32
MOONCAKE_RATES = {"slow": 8.0, "fast": 4.0}
WORKLOADS = ("azure", "mooncake")
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


def measured_hit_rate(records: Any) -> float | None:
    """Cached over prompt tokens, as the workers reported them."""
    reuse = prefix_figures(records)
    return None if reuse is None else reuse.hit_rate


def predicted(result: dict[str, Any]) -> dict[str, float | None]:
    overall = result["overall"]
    cache = result.get("prefix_cache")
    return {
        "ttft_p50_ms": overall["ttft_s"]["p50"] * 1000,
        "ttft_p99_ms": overall["ttft_s"]["p99"] * 1000,
        "itl_p99_ms": overall["itl_s"]["p99"] * 1000,
        "goodput": result["goodput"],
        "hit_rate": None if cache is None else cache["hit_rate"],
    }


def error(measured: float | None, guess: float | None) -> float | None:
    if measured is None or guess is None or measured == 0:
        return None
    return (guess - measured) / measured * 100


def load_average() -> list[float]:
    """The machine's load average now (reported beside every figure)."""
    return [round(value, 2) for value in os.getloadavg()]


def bench_config(
    workload: str, rate: str, trace_dir: Path, seed: int, url: str, vocab: int
) -> BenchConfig:
    """The traffic of one run, as `pdserve bench` is configured for it."""
    common: dict[str, Any] = {
        "url": url, "seed": seed, "slo": SLO_TARGETS, "drain_timeout_s": 300.0,
        "vocab_size": vocab,
    }  # fmt: skip
    if workload == "mooncake":
        if not MOONCAKE.is_file():
            pytest.skip(f"no trace at {MOONCAKE}")
        return BenchConfig(
            trace=MOONCAKE, num_requests=MOONCAKE_REQUESTS,
            trace_time_scale=MOONCAKE_RATES[rate], trace_length_scale=MOONCAKE_LENGTH_SCALE,
            max_output_tokens=MOONCAKE_MAX_OUTPUT_TOKENS, **common,
        )  # fmt: skip
    trace = scaled_trace(trace_dir / f"azure-{rate}.csv", RATES[rate])
    return BenchConfig(trace=trace, max_output_tokens=MAX_OUTPUT_TOKENS, **common)


def rates_of(workload: str) -> list[str]:
    return list(MOONCAKE_RATES if workload == "mooncake" else RATES)


def accuracy_pool(tiny_model_dir: Path) -> Any:
    manifest = demo_pool(tiny_model_dir)
    manifest["spec"]["slo"] = {"ttft": {"seconds": 2.0}, "itl": {"seconds": 0.2}}
    return api.parse_pool(manifest)


def test_profile_this_machine(tiny_model_dir: Path) -> None:
    before = load_average()
    profile = profile_model(
        ProfileRun(tiny_model_dir, "full", True, "nixl", ("--dtype", "float32"))
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    write_profile(profile, RESULTS_DIR / "plan_profile.json")
    print(
        f"profile: step fit error mean {profile.step_fit.mean_abs:.1%} "
        f"(held out {profile.step_fit.holdout_mean_abs}), cost {profile.step_cost}, "
        f"serving {profile.serving}, cores {profile.cores} threads {profile.threads}, "
        f"contention {profile.contention}, clients {profile.clients}, "
        f"handoff {profile.handoff.fixed_s:.4f}s + "
        f"{profile.handoff.per_byte_s:.3g}s/B, request overhead {profile.request_overhead_s:.4f}s; "
        f"load average before {before}, after {load_average()}"
    )


@pytest.mark.parametrize("workload", WORKLOADS)
def test_measure_a_workload(workload: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = accuracy_pool(tiny_model_dir)
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    runs: list[dict[str, Any]] = []
    with local_pool(pool, tmp_path / "pool") as local:
        workers = local.workers["prefill"] + local.workers["decode"]
        for rate_index, rate in enumerate(rates_of(workload)):
            for routing_index, (routing, buckets) in enumerate(ROUTINGS.items()):
                # A seed of its own per run: no run finds another's prompts cached,
                # which the simulator, starting each run empty, would not see.
                seed = rate_index * len(ROUTINGS) + routing_index
                use_buckets(local, buckets)
                config = bench_config(workload, rate, tmp_path, seed, local.url, vocab)
                before = load_average()
                measured = run_benchmark(config)
                wait_until(
                    lambda: all(worker_load(w.url)["in_flight"] == 0 for w in workers),
                    120, "the workers to drain",
                )  # fmt: skip
                real = figures(measured.metrics)
                real["hit_rate"] = measured_hit_rate(measured.records)
                runs.append({
                    "workload": workload, "rate": rate, "routing": routing, "seed": seed,
                    "measured": real, "load_average": [before, load_average()],
                })  # fmt: skip
                print(f"{workload} {rate} {routing}: {real} load {runs[-1]['load_average']}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"plan_measured_{workload}.json"
    path.write_text(json.dumps({"runs": runs}, indent=2))


def simulated(
    profile: Profile, pool: Any, run: dict[str, Any], trace_dir: Path, vocab: int
) -> dict[str, Any]:
    """The simulator's figures for one measured run's traffic and routing."""
    config = bench_config(run["workload"], run["rate"], trace_dir, run["seed"], "sim", vocab)
    buckets = ROUTINGS[run["routing"]]
    spec = api.parse_spec({**api.dump(pool.spec), "routing": {"buckets": buckets}})
    candidate = Candidate("bucketed", 1, 1, "", None, spec)
    line = scenario_line(pool.metadata.name, candidate, (50, 99), (BUCKET_BOUNDARY,), "one-host")
    return simulate(parse_scenario(line), profile, traffic_of(config, profile.model))


def test_predicted_against_measured(tiny_model_dir: Path, tmp_path: Path) -> None:
    measured_files = [RESULTS_DIR / f"plan_measured_{w}.json" for w in WORKLOADS]
    profile_file = RESULTS_DIR / "plan_profile.json"
    if not profile_file.is_file() or not any(f.is_file() for f in measured_files):
        pytest.skip("run test_profile_this_machine and test_measure_a_workload first")
    profile = load_profile(profile_file)
    pool = accuracy_pool(tiny_model_dir)
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    rows: list[dict[str, Any]] = []
    speeds: list[float] = []
    for path in (f for f in measured_files if f.is_file()):
        for run in json.loads(path.read_text())["runs"]:
            result = simulated(profile, pool, run, tmp_path, vocab)
            speeds.append(result["simulated_s"] / result["wall_s"])
            real, guess = run["measured"], predicted(result)
            row: dict[str, Any] = {k: run[k] for k in ("workload", "rate", "routing")}
            for key in real:
                row[f"{key} measured"] = real[key]
                row[f"{key} predicted"] = guess[key]
                row[f"{key} error %"] = error(real[key], guess[key])
            row["load average"] = run["load_average"][1][0]
            rows.append(row)
    ranking = {}
    for group in sorted({(r["workload"], r["rate"]) for r in rows}):
        mine = [r for r in rows if (r["workload"], r["rate"]) == group]
        by_real = sorted(mine, key=lambda r: r["ttft_p99_ms measured"])
        by_guess = sorted(mine, key=lambda r: r["ttft_p99_ms predicted"])
        ranking[" ".join(group)] = [r["routing"] for r in by_real] == [
            r["routing"] for r in by_guess
        ]
    errors = [abs(v) for r in rows for k, v in r.items() if k.endswith("error %") and v is not None]
    publish(
        "plan_accuracy", rows,
        {"step_fit": profile.step_fit.model_dump(), "handoff": profile.handoff.model_dump(),
         "serving": profile.serving.model_dump(),
         "contention": profile.contention.model_dump(), "clients": profile.clients.model_dump(),
         "request_overhead_s": profile.request_overhead_s,
         "ranking_by_ttft_p99_agrees": ranking,
         "errors_within_10_percent": f"{sum(e <= 10 for e in errors)}/{len(errors)}",
         "simulated_seconds_per_wall_second": speeds, "load_average": load_average()},
    )  # fmt: skip
