"""The simulator's predictions against measurement on this machine, in three parts
that each take under fifteen minutes, so that each can run while the machine is quiet:

- `test_profile_this_machine`: the tiny model profiled here (`pdserve profile`: the
  full sweep, workers stepping together, a worker pair and a router in front of it),
  written to out/bench/plan_profile.json;
- `test_measure_a_workload[azure|mooncake]`: one pool (the demo's: one prefill and
  one decode worker, KV-aware routing) serves a slice of the Azure conversation trace
  or of the Mooncake synthetic trace (prefixes shared as the trace says), scaled to
  this machine, routed three ways (colocated, bucketed, disaggregated) at two rates
  (the fast one near where the colocated pool saturates, so the routings differ),
  and the colocated routing once more at each rate with prompts of its own: the
  run-to-run noise. The measured figures go to out/bench/plan_measured_<workload>.json,
  each request's record to out/bench/plan_records_<workload>.json;
- `test_predicted_against_measured`: the simulator replays each run's traffic on the
  same pool's configuration with that profile, every process on this machine's cores
  as they ran (placement one-host). Per run: measured and predicted TTFT
  P50/P99, ITL P99, goodput and prefix-cache hit rate, the error of each, and the
  simulator's speed. The ranking of the routings (by TTFT P99) is judged per workload
  and rate only between routings whose measured gap exceeds the noise the repeated
  run showed there: within it the order is not defined, and the table says so.

Run with `make bench`, or a part at a time with -k."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import time
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
from support.cpu import CpuSampler
from support.results import RESULTS_DIR, publish
from support.router import local_pool, router_metric, worker_load
from support.step_log import step_logging_env
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
TRACE = TRACES / "azure_llm_2023_conv.csv"
MOONCAKE = TRACES / "mooncake_synthetic.jsonl"
START_S = 600.0  # past the trace's sparse first minutes
SECONDS = 30.0  # of arrivals per run
LENGTH_SCALE = 0.25
MAX_OUTPUT_TOKENS = 128
# Trace seconds stretched by these factors. The fast rate is where the routings part:
# the colocated worker's prefill chunks start to hold up its decodes and queue.
RATES = {"slow": 6.0, "fast": 1.5}
# The Mooncake trace: its first requests, blocks of 512 tokens scaled to 32.
MOONCAKE_REQUESTS = 30
MOONCAKE_LENGTH_SCALE = 1 / 16
MOONCAKE_MAX_OUTPUT_TOKENS = 32
MOONCAKE_RATES = {"slow": 8.0, "fast": 4.0}
WORKLOADS = ("azure", "mooncake")
SLO_TARGETS = SLO(ttft_ms=2000.0, itl_ms=200.0)
# The routing run twice at each rate (the second time with prompts of its own): the
# difference between the two is the run-to-run noise.
REPEATED = "colocated"
REPEAT_SEED = 100
RANKED_BY = "ttft_p99_ms"
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

    def ms(distribution: Any, quantile: str) -> float | None:
        if distribution is None:
            return None
        seconds: float = getattr(distribution, quantile)
        return seconds * 1000

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


def predicted_spread(result: dict[str, Any]) -> dict[str, float | None]:
    """The latency figures' standard deviation across the simulator's draws, in percent
    of their mean."""
    spread = result.get("spread", {}).get("overall", {})
    figures = {"ttft_p50_ms": ("ttft_s", "p50"), "ttft_p99_ms": ("ttft_s", "p99"),
               "itl_p99_ms": ("itl_s", "p99")}  # fmt: skip
    found: dict[str, float | None] = {}
    for key, (metric, label) in figures.items():
        mean, deviation = (result["overall"].get(metric) or {}).get(label), None
        if mean and spread.get(metric):
            deviation = spread[metric].get(label)
        found[key] = None if deviation is None or not mean else 100.0 * deviation / mean
    return found


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
        f"{profile.handoff.per_byte_s:.3g}s/B, request overhead {profile.request_overhead_s:.4f}s "
        f"(busy worker {profile.busy_request_overhead_s}), serving spread "
        f"{spread_figures(profile.serving.spread)}, contention spreads "
        f"{[(n, spread_figures(spread)) for n, spread in profile.contention.spreads]}; "
        f"load average before {before}, after {load_average()}"
    )
    for name, spread in profile.spreads.items():  # each figure as each round gave it
        print(f"  {name}: rounds {', '.join(f'{value:.4g}' for value in spread.rounds)}")


def planned_runs(workload: str) -> list[tuple[str, str, int]]:
    """(rate, routing, seed) of each run of a workload: every routing at each rate,
    then the repeated one. A seed of its own per run: no run finds another's prompts
    cached, which the simulator, starting each run empty, would not see."""
    runs = []
    for rate_index, rate in enumerate(rates_of(workload)):
        for routing_index, routing in enumerate(ROUTINGS):
            runs.append((rate, routing, rate_index * len(ROUTINGS) + routing_index))
        runs.append((rate, REPEATED, REPEAT_SEED + rate_index))
    return runs


@pytest.mark.parametrize("workload", WORKLOADS)
def test_measure_a_workload(workload: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = accuracy_pool(tiny_model_dir)
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    runs: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    logs = RESULTS_DIR / f"plan_logs_{workload}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    env = {role: step_logging_env() for role in ("prefill", "decode")}
    with (
        local_pool(pool, tmp_path / "pool", env=env) as local,
        CpuSampler(pool_processes(local), logs / "cpu.jsonl"),
    ):
        workers = local.workers["prefill"] + local.workers["decode"]
        for rate, routing, seed in planned_runs(workload):
            use_buckets(local, ROUTINGS[routing])
            config = bench_config(workload, rate, tmp_path, seed, local.url, vocab)
            before, started = load_average(), time.time()
            measured = run_benchmark(config)
            wait_until(
                lambda: all(worker_load(w.url)["in_flight"] == 0 for w in workers),
                120, "the workers to drain",
            )  # fmt: skip
            real = figures(measured.metrics)
            real["hit_rate"] = measured_hit_rate(measured.records)
            runs.append({
                "workload": workload, "rate": rate, "routing": routing, "seed": seed,
                "repeat": seed >= REPEAT_SEED, "measured": real,
                "load_average": [before, load_average()],
                "wall_clock": [started, time.time()],  # to find the run in the workers' logs
            })  # fmt: skip
            records.append({
                "rate": rate, "routing": routing, "seed": seed,
                "records": [dataclasses.asdict(record) for record in measured.records],
            })  # fmt: skip
            print(
                f"{workload} {rate} {routing} seed {seed}: {real} load {runs[-1]['load_average']}"
            )
        for worker in workers:  # each step's chunks and time, to line up with the simulator's
            shutil.copy(worker.log_path, logs / worker.log_path.name)
    path = RESULTS_DIR / f"plan_measured_{workload}.json"
    path.write_text(json.dumps({"runs": runs}, indent=2))
    (RESULTS_DIR / f"plan_records_{workload}.json").write_text(json.dumps(records))


def pool_processes(local: Any) -> dict[str, int]:
    """The pool's processes by name, and this one (the load generator's), whose CPU
    the bench samples beside the workers' steps."""
    named = {"client": os.getpid(), "router": local.router.process.pid}
    for role in ("prefill", "decode"):
        for index, worker in enumerate(local.workers[role]):
            named[f"{role}-{index}"] = worker.process.pid
    return named


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
    noise: dict[tuple[str, str], dict[str, float | None]] = {}
    for path in (f for f in measured_files if f.is_file()):
        runs = json.loads(path.read_text())["runs"]
        noise.update(repeat_noise(runs))
        for run in (run for run in runs if not run.get("repeat")):
            result = simulated(profile, pool, run, tmp_path, vocab)
            speeds.append(result["simulated_s"] * result["draws"] / result["wall_s"])
            real, guess = run["measured"], predicted(result)
            spread = predicted_spread(result)
            row: dict[str, Any] = {k: run[k] for k in ("workload", "rate", "routing")}
            for key in real:
                row[f"{key} measured"] = real[key]
                row[f"{key} predicted"] = guess[key]
                if key in spread:  # how far the simulator's draws fell from their mean
                    row[f"{key} predicted spread %"] = spread[key]
                row[f"{key} error %"] = error(real[key], guess[key])
            row["load average"] = run["load_average"][1][0]
            rows.append(row)
    ranking = {
        f"{workload} {rate}": ranking_of(
            [r for r in rows if (r["workload"], r["rate"]) == (workload, rate)],
            noise.get((workload, rate)),
        )
        for workload, rate in sorted({(r["workload"], r["rate"]) for r in rows})
    }
    errors = [abs(v) for r in rows for k, v in r.items() if k.endswith("error %") and v is not None]
    publish(
        "plan_accuracy", rows,
        {"step_fit": profile.step_fit.model_dump(), "handoff": profile.handoff.model_dump(),
         "serving": profile.serving.model_dump(),
         "contention": profile.contention.model_dump(), "clients": profile.clients.model_dump(),
         "request_overhead_s": profile.request_overhead_s,
         "busy_request_overhead_s": profile.busy_request_overhead_s,
         "serving_spread": spread_figures(profile.serving.spread),
         "contention_spreads": {level: spread_figures(spread)
                                for level, spread in profile.contention.spreads},
         "noise_percent_from_a_repeat": {" ".join(group): figures
                                         for group, figures in sorted(noise.items())},
         "ranking_by_ttft_p99": ranking,
         "errors_within_10_percent": f"{sum(e <= 10 for e in errors)}/{len(errors)}",
         "simulated_seconds_per_wall_second": speeds, "load_average": load_average()},
    )  # fmt: skip


def repeat_noise(runs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float | None]]:
    """Per workload and rate, how far the repeated routing's second run fell from its
    first, in percent of the first, per figure."""
    noise = {}
    for again in (run for run in runs if run.get("repeat")):
        key = (again["workload"], again["rate"])
        first = next(
            run for run in runs
            if not run.get("repeat") and (run["workload"], run["rate"]) == key
            and run["routing"] == again["routing"]
        )  # fmt: skip
        noise[key] = {
            name: None if (gap := error(value, again["measured"][name])) is None else abs(gap)
            for name, value in first["measured"].items()
        }
    return noise


def ranking_of(rows: list[dict[str, Any]], noise: dict[str, float | None] | None) -> dict[str, Any]:
    """Whether the predicted order of the routings agrees with the measured one, pair by
    pair, counting only pairs whose measured gap exceeds the noise (percent of the
    lower): within it the measured order is not defined."""
    threshold = None if noise is None else noise.get(RANKED_BY)
    decided, right, undefined = 0, 0, []
    for one, other in itertools.combinations(rows, 2):
        low, high = sorted((one[f"{RANKED_BY} measured"], other[f"{RANKED_BY} measured"]))
        names = f"{one['routing']}/{other['routing']}"
        if threshold is None or (high - low) / low * 100 <= threshold:
            undefined.append(names)
            continue
        decided += 1
        measured_first = one[f"{RANKED_BY} measured"] < other[f"{RANKED_BY} measured"]
        right += measured_first == (one[f"{RANKED_BY} predicted"] < other[f"{RANKED_BY} predicted"])
    return {
        "noise_percent": threshold, "pairs_decided": decided, "pairs_right": right,
        "within_noise": undefined,
        "measured_order": order_by(rows, "measured"),
        "predicted_order": order_by(rows, "predicted"),
    }  # fmt: skip


def order_by(rows: list[dict[str, Any]], side: str) -> list[str]:
    """The routings from the lowest ranking figure to the highest."""
    return [r["routing"] for r in sorted(rows, key=lambda r: r[f"{RANKED_BY} {side}"])]


def spread_figures(spread: Any) -> dict[str, float] | None:
    """A spread's median, P90, P99 and largest ratio (None: none measured)."""
    if not spread.quantiles:
        return None
    last = len(spread.quantiles) - 1
    return {f"p{q}": spread.quantiles[round(q / 100 * last)] for q in (50, 90, 99, 100)}
