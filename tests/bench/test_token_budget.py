"""The adaptive token budget against every static budget of a sweep, under one ITL
target, on the three workload shapes (short in/short out, long in/short out, long
in/long out), the mixed one and a burst (the first requests of the Azure conversation
trace, arriving within seconds, prompts up to 3,000 tokens), in one run; then a load
step (the mixed shape from half the best static budget's capacity to past it, that
capacity measured first on this machine) and how many engine steps the ITL takes to
come back under target. PDSERVE_BENCH_LOAD_STEP=256,512 runs the load step alone,
against those static budgets (`test_load_step_alone`).
Run with `make bench`. PDSERVE_BENCH_RATE_SCALE multiplies every request rate (default
1): the rates below suit a shared two-core machine, where an idle one needs more traffic
before the budget matters.

The adaptive budget is judged against the best static budget of each shape: the one
with the lowest median TTFT among those whose P99 ITL meets the target. Every
configuration of a shape gets the same requests at the same times (one seed), so a
TTFT P50 is the same few requests' in each; a shape's run holds enough requests that
the TTFTs next to its median lie within about 2.5% of it (40 prompts of 1024-3072 tokens
are about 50 tokens apart; with 14 they were 7% apart and one request's place decided a
5% verdict). Beside the P50 ratio, the median of the same requests' TTFT ratios, which
no request's place decides.

One run per configuration does not settle a 5% verdict on a shared machine: its
configurations run one after another, minutes apart, and the machine's pace moves
between them. Static 256 and 512 compute the same steps on the short shape (its
prompts fit both), yet came out 7% apart in one run (25.0 against 26.7 ms); on the
mixed shape, whose median request is a short one (the simulator with exact costs puts
both at 25.8 ms), 13% (32.7 against 29.0 ms); the same static moved 7-25% between
runs. So where the first run's verdict is close (the adaptive P50 within REMATCH_BAND
of the tolerance, either way), the adaptive budget and the best static one run again,
REMATCH_ROUNDS more times, the order reversed each round (adaptive first in the first
rematch, as it ran last in the sweep, so a steady drift weighs on both alike), on the
same requests; the verdict then takes the P50 and the paired ratio over every round's
requests (the drift balanced, each step's noise drawn twice), and the first run's
ratio is reported beside it. The same requests make each round's P50 of one
configuration comparable with the other's: how far they move apart is the drift
(`drift_*` in the verdicts; in the first locked run with rounds, static 512 on the short
shape went 24.1 -> 31.0 ms between its rounds, the adaptive budget on the mixed shape
32.7 -> 28.4 ms, which took the first-run ratios from 1.01x and 1.11x to 0.89x and 1.01x
pooled). The best static is still the sweep's (the first run).
"""

from __future__ import annotations

import csv
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.metrics import SLO, GroupMetrics, token_times
from pdserve.workers.bench.runner import BenchResult, run_benchmark
from pdserve.workers.bench.workloads import workload_named
from pdserve.workers.engine.config import ModelConfig
from support.results import publish
from support.worker import ServerProcess, metric, running_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

TARGET_ITL_MS = 200.0
SWEEP = (64, 128, 256, 512, 1024, 2048)
ADAPTIVE = "adaptive"
# The adaptive budget may go as high as the sweep does.
CEILING = SWEEP[-1]
RATE_SCALE = float(os.environ.get("PDSERVE_BENCH_RATE_SCALE", "1"))
# Long outputs take a while on two cores: let the last requests finish.
DRAIN_S = 180.0
# Goodput: requests whose TTFT and TPOT both meet their targets.
SLO_TTFT_MS = 5000.0
TTFT_TOLERANCE = 1.05  # "within 5% of the best static budget"
# A verdict is close (rematched, see above) where the first run's P50 ratio lies within
# this factor of the tolerance: the spread seen between configurations that compute the
# same steps in one run.
REMATCH_BAND = 1.15
REMATCH_ROUNDS = int(os.environ.get("PDSERVE_BENCH_REMATCH_ROUNDS", "1"))
STEPS = "pdserve_engine_step_duration_seconds_count"
OVER_TARGET = "pdserve_engine_steps_over_target_total"
PREEMPTIONS = "pdserve_preemptions_total"


# The burst: the trace's first requests, their arrivals squeezed into BURST_S.
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_conv.csv"
BURST_REQUESTS = 60
BURST_S = 10.0
BURST_MAX_INPUT = 3000
BURST_MAX_OUTPUT = 256


@dataclass(frozen=True)
class Shape:
    """A workload shape and a request rate the tiny model on two cores keeps up with,
    or (workload "burst") the trace's burst."""

    name: str
    workload: str
    base_rate: float = 0.0
    duration_s: float = 60.0  # of arrivals: base_rate x duration_s requests

    @property
    def rate(self) -> float:
        """Requests per second in this run."""
        return self.base_rate * RATE_SCALE

    def traffic(self, logs: Path) -> dict[str, Any]:
        """The bench configuration's traffic fields."""
        if self.workload != "burst":
            return {"workload": self.workload, "rate": self.rate, "duration_s": self.duration_s}
        trace, span_s = write_burst_trace(logs / "burst.csv")
        return {
            "trace": trace,
            "trace_time_scale": BURST_S / span_s,
            "max_input_tokens": BURST_MAX_INPUT,
            "max_output_tokens": BURST_MAX_OUTPUT,
        }


ALL_SHAPES = (
    Shape("short-in/short-out", "chat", 1.0, 60.0),
    Shape("long-in/short-out", "rag", 0.5, 80.0),
    # 36 requests: at 0.12 req/s for 60 s it had 7, and one request's place decided its
    # P50 (1.25-1.59x while the paired ratio said 0.94-0.98).
    Shape("long-in/long-out", "long", 0.25, 160.0),
    Shape("mixed", "mixed", 0.75, 70.0),
    *((Shape("burst", "burst"),) if TRACE.exists() else ()),
)
# PDSERVE_BENCH_SHAPES=mixed,burst runs those workloads only (the load step runs with
# mixed only: it compares the adaptive budget with the best static one of that shape).
_CHOSEN = os.environ.get("PDSERVE_BENCH_SHAPES")
SHAPES = tuple(s for s in ALL_SHAPES if not _CHOSEN or s.workload in _CHOSEN.split(","))
# PDSERVE_BENCH_BUDGETS=64,128,256 runs those static budgets only (beside the adaptive
# one), to fit a sweep into a shorter run where the larger ones are known to miss the
# target; the verdicts then judge against the best of those.
_STATICS = os.environ.get("PDSERVE_BENCH_BUDGETS")
STATICS = tuple(int(size) for size in _STATICS.split(",")) if _STATICS else SWEEP


def statics_of(shape: Shape) -> tuple[int, ...]:
    """The static budgets run on `shape`: PDSERVE_BENCH_BUDGETS_<WORKLOAD> (e.g.
    PDSERVE_BENCH_BUDGETS_RAG=512,1024) where set, else STATICS."""
    sizes = os.environ.get(f"PDSERVE_BENCH_BUDGETS_{shape.workload.upper()}")
    return tuple(int(size) for size in sizes.split(",")) if sizes else STATICS


def write_burst_trace(path: Path) -> tuple[Path, float]:
    """The trace's first BURST_REQUESTS rows, and the seconds their arrivals span."""
    with TRACE.open(newline="") as source:
        rows = list(csv.reader(source))[: BURST_REQUESTS + 1]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    first, last = (datetime.fromisoformat(row[0][:26]) for row in (rows[1], rows[-1]))
    return path, (last - first).total_seconds()


# The load step: the mixed shape at LOAD_BEFORE of the best static budget's capacity,
# then LOAD_AFTER of it from LOAD_STEP_AT_S on: past what that budget sustains, where a
# budget that computes more per step under the same target is worth the most. The
# capacity is measured first (`measure_capacity`): CAPACITY_REQUESTS mixed requests all
# at once, and the tokens (prompt and output) the static budget's worker serves per
# second flat out, in the mixed workload's average requests per second. Counting the
# probe's requests instead read about 1.4x what the worker sustains (simulator, exact
# costs, static 256: 9.2 req/s, where a Poisson stream's queue stays bounded up to
# 6.25-6.5 req/s and grows from 6.75): its 40 requests are lighter than the workload's
# average (5 long prompts, a mean prompt of 316 tokens against 443), so "1.25x" was a
# step to about 1.8x. Counted in tokens the same probe reads 6.8 req/s.
LOAD_BEFORE, LOAD_AFTER = 0.5, 1.25
CAPACITY_REQUESTS = 40
LOAD_STEP_AT_S = 30.0
LOAD_DURATION_S = 60.0
RECOVERY_WINDOW_STEPS = 100  # P99 under target: at most 1% of such a window's steps over
WINDOW_S = 5.0


@dataclass(frozen=True)
class Run:
    """One configuration on one shape: the client's figures and the worker's steps."""

    shape: str
    budget: str  # a static budget's size, or "adaptive"
    metrics: GroupMetrics
    steps: float
    steps_over_target: float
    preemptions: float = 0.0
    longest_gap_s: float = 0.0  # the longest gap between two tokens of one stream
    ttfts: tuple[tuple[int, float], ...] = ()  # (request index, TTFT s) of each served
    round: int = 0  # 0: the sweep; 1...: the rematch rounds (the same requests again)

    @property
    def p99_itl_ms(self) -> float:
        """P99 ITL; infinite when no request streamed two tokens (a run that failed
        meets nothing)."""
        itl = self.metrics.itl
        return math.inf if itl is None else itl.p99 * 1e3

    @property
    def ttft_ms(self) -> tuple[float, float]:
        """TTFT P50 and P99 (infinite when no request got a token)."""
        ttft = self.metrics.ttft
        return (math.inf, math.inf) if ttft is None else (ttft.p50 * 1e3, ttft.p99 * 1e3)

    @property
    def meets_target(self) -> bool:
        return self.p99_itl_ms <= TARGET_ITL_MS

    def row(self) -> dict[str, Any]:
        ttft_p50, ttft_p99 = self.ttft_ms
        return {
            "shape": self.shape,
            "budget": self.budget,
            "round": self.round,
            "requests": self.metrics.requests,
            "failed": self.metrics.failed,
            "itl_p99_ms": self.p99_itl_ms,
            "meets": "yes" if self.meets_target else "no",
            "ttft_p50_ms": ttft_p50,
            "ttft_p99_ms": ttft_p99,
            "goodput_rps": self.metrics.goodput,
            "steps_over_target": self.steps_over_target / max(self.steps, 1.0),
            "preemptions": self.preemptions,
            "longest_gap_s": self.longest_gap_s,
        }


def budget_args(budget: str) -> list[str]:
    """Worker flags of a configuration; both kinds count the steps over the target."""
    # A burst queues requests for longer than the default queue timeout.
    target = ["--target-itl-ms", f"{TARGET_ITL_MS:g}", "--queue-timeout", f"{DRAIN_S:g}"]
    if budget == ADAPTIVE:
        return [*target, "--token-budget", ADAPTIVE, "--max-num-batched-tokens", str(CEILING)]
    return [*target, "--max-num-batched-tokens", budget]


def bench_config(url: str, vocab: int, **traffic: Any) -> BenchConfig:
    slo = SLO(ttft_ms=SLO_TTFT_MS, tpot_ms=TARGET_ITL_MS)
    return BenchConfig(
        url=url, seed=12, vocab_size=vocab, slo=slo, drain_timeout_s=DRAIN_S, **traffic
    )


def measure(model_dir: Path, logs: Path, shape: Shape, budget: str, round: int = 0) -> Run:
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    log_dir = logs / shape.workload / budget / str(round)
    with running_worker(model_dir, log_dir, *budget_args(budget)) as worker:
        config = bench_config(worker.url, vocab, **shape.traffic(log_dir))
        result = run_benchmark(config)
        run = Run(
            shape.name,
            budget,
            result.metrics.overall,
            metric(worker, STEPS),
            metric(worker, OVER_TARGET),
            metric(worker, PREEMPTIONS),
            longest_gap_s(result),
            request_ttfts(result),
            round,
        )
    print(run.row(), flush=True)  # a long sweep shows its progress
    return run


def request_ttfts(result: BenchResult) -> tuple[tuple[int, float], ...]:
    """Each served request's TTFT, by its index in the run (the same request in every
    configuration of a shape)."""
    return tuple(
        (record.index, token_times(record)[0] - record.sent_at)
        for record in result.records
        if record.ok and record.sent_at is not None
    )


def paired_ttft_ratio(ours: Sequence[Run], theirs: Sequence[Run]) -> float | None:
    """The median, over the requests both served (a request: its round and index), of
    our TTFT over theirs."""
    their_ttfts = {(run.round, i): ttft for run in theirs for i, ttft in run.ttfts}
    ratios = [
        ttft / their_ttfts[run.round, i]
        for run in ours
        for i, ttft in run.ttfts
        if their_ttfts.get((run.round, i))
    ]
    return float(np.median(ratios)) if ratios else None


def pooled_ttft_p50_ms(runs: Sequence[Run]) -> float:
    """The TTFT P50 over every request of `runs` (a configuration's rounds)."""
    ttfts = [ttft for run in runs for _, ttft in run.ttfts]
    return float(np.median(ttfts)) * 1e3 if ttfts else math.inf


def is_close(adaptive: Run, best: Run | None) -> bool:
    """Whether the first run's verdict on a shape is close enough to rematch (see the
    module's docstring)."""
    if best is None or not adaptive.meets_target:
        return False
    ratio = adaptive.ttft_ms[0] / best.ttft_ms[0]
    return TTFT_TOLERANCE / REMATCH_BAND <= ratio <= TTFT_TOLERANCE * REMATCH_BAND


def rematch_order(round: int, best: str) -> tuple[str, str]:
    """The configurations of a rematch round, in the order they run: the sweep ran the
    adaptive budget last, so the first rematch runs it first, and so on alternately."""
    return (ADAPTIVE, best) if round % 2 else (best, ADAPTIVE)


def longest_gap_s(result: BenchResult) -> float:
    """The longest gap between two tokens of any stream of a run."""
    gaps = [
        later - earlier
        for record in result.records
        if record.ok
        for earlier, later in pairwise(token_times(record))
    ]
    return max(gaps, default=0.0)


def best_static(runs: Sequence[Run]) -> Run | None:
    """The static budget with the lowest median TTFT among those meeting the target,
    in the sweep (the first run of each)."""
    meeting = [r for r in runs if r.budget != ADAPTIVE and r.round == 0 and r.meets_target]
    return min(meeting, key=lambda r: r.ttft_ms, default=None)


def verdicts(by_shape: dict[str, list[Run]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per shape: the best static budget and how the adaptive one compares; across
    shapes: whether any single static budget is as good everywhere."""
    rows = []
    for shape, runs in by_shape.items():
        adaptive = next(r for r in runs if r.budget == ADAPTIVE and r.round == 0)
        best = best_static(runs)
        p50, p99 = adaptive.ttft_ms
        rounds = [r for r in runs if r.budget == ADAPTIVE]
        theirs = [r for r in runs if best and r.budget == best.budget]
        pooled = pooled_ttft_p50_ms(rounds) / pooled_ttft_p50_ms(theirs) if best else None
        meets = all(r.meets_target for r in rounds)
        rows.append(
            {
                "shape": shape,
                "best_static": best.budget if best else "none meets",
                "rounds": len(rounds),
                "adaptive_meets": meets,
                "ttft_p50_adaptive_over_best": pooled,
                "ttft_p50_first_run": p50 / best.ttft_ms[0] if best else None,
                "ttft_p99_first_run": p99 / best.ttft_ms[1] if best else None,
                "ttft_paired_median_ratio": paired_ttft_ratio(rounds, theirs) if best else None,
                # The same requests again: how far each moved between its rounds.
                "drift_adaptive": rounds[-1].ttft_ms[0] / p50,
                "drift_best_static": theirs[-1].ttft_ms[0] / best.ttft_ms[0] if best else None,
                "goal_met": bool(pooled is not None and meets and pooled <= TTFT_TOLERANCE),
            }
        )
    everywhere = {
        str(size): all(_as_good_as_best(size, runs) for runs in by_shape.values())
        for size in STATICS
        if all(any(r.budget == str(size) for r in runs) for runs in by_shape.values())
    }
    return rows, {"static_as_good_as_best_on_every_shape": everywhere}


def _as_good_as_best(size: int, runs: Sequence[Run]) -> bool:
    best = best_static(runs)
    run = next(r for r in runs if r.budget == str(size) and r.round == 0)
    return (
        best is not None and run.meets_target and run.ttft_ms[0] <= TTFT_TOLERANCE * best.ttft_ms[0]
    )


def test_adaptive_budget_against_the_best_static_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    by_shape: dict[str, list[Run]] = {}
    for shape in SHAPES:
        budgets = [*(str(size) for size in statics_of(shape)), ADAPTIVE]
        runs = by_shape[shape.name] = [measure(tiny_model_dir, tmp_path, shape, b) for b in budgets]
        best = best_static(runs)
        if best is None or not is_close(runs[-1], best):
            continue
        for round in range(1, REMATCH_ROUNDS + 1):
            for budget in rematch_order(round, best.budget):
                runs.append(measure(tiny_model_dir, tmp_path, shape, budget, round))
    runs = [run for shape_runs in by_shape.values() for run in shape_runs]
    judged, across = verdicts(by_shape)
    publish(
        "token_budget_sweep",
        [run.row() for run in runs],
        {
            "target_itl_ms": TARGET_ITL_MS,
            "duration_s": {s.name: s.duration_s for s in SHAPES if s.workload != "burst"},
            "rates": {shape.name: shape.rate for shape in SHAPES if shape.workload != "burst"},
            "static_budgets": {shape.name: list(statics_of(shape)) for shape in SHAPES},
            "rematch": f"{REMATCH_ROUNDS} rounds where the first run's P50 ratio is within "
            f"{REMATCH_BAND:g}x of {TTFT_TOLERANCE:g}",
            "burst": f"first {BURST_REQUESTS} requests of {TRACE.name} within {BURST_S:g} s, "
            f"prompts <= {BURST_MAX_INPUT}, outputs <= {BURST_MAX_OUTPUT} tokens",
            "verdicts": judged,
            **across,
        },
    )
    publish("token_budget_verdicts", judged, across)
    assert all(run.metrics.failed == 0 for run in runs)
    if "mixed" in by_shape:
        mixed = best_static(by_shape["mixed"])
        fallback = str(statics_of(next(s for s in SHAPES if s.workload == "mixed"))[0])
        load_step(tiny_model_dir, tmp_path, (mixed.budget if mixed else fallback,))


# -- the load step ----------------------------------------------------------------------


# PDSERVE_BENCH_LOAD_STEP=256,512 runs the load step alone (no sweep), against those
# static budgets: the first one's capacity sets the rates, and the adaptive budget runs
# after each static one (256, adaptive, 512, adaptive), so a drift weighs on both sides.
_LOAD_STEP_STATICS = os.environ.get("PDSERVE_BENCH_LOAD_STEP")


@pytest.mark.skipif(not _LOAD_STEP_STATICS, reason="PDSERVE_BENCH_LOAD_STEP not set")
def test_load_step_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    statics = tuple((_LOAD_STEP_STATICS or "").split(","))
    load_step(tiny_model_dir, tmp_path, statics)


def load_step(model_dir: Path, logs: Path, statics: Sequence[str]) -> None:
    """The mixed shape from LOAD_BEFORE to LOAD_AFTER of the first static budget's
    capacity halfway, on the same arrivals: each static budget, the adaptive one after
    each (its runs after the first are labelled `adaptive 2`, ...)."""
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    rows: list[dict[str, Any]] = []
    recovery: dict[str, int | None] = {}
    probe: Capacity | None = None
    windows: dict[str, list[float | None]] = {}
    # Each adaptive run's label, and the static run before it.
    pairs = {(ADAPTIVE if i == 0 else f"{ADAPTIVE} {i + 1}"): s for i, s in enumerate(statics)}
    runs = [run for label, s in pairs.items() for run in ((s, s), (ADAPTIVE, label))]
    for budget, label in runs:  # (the worker's budget, the run's label)
        with running_worker(model_dir, logs / "step" / label, *budget_args(budget)) as worker:
            if probe is None:  # the first static: its capacity sets the rates
                probe = measure_capacity(worker.url, vocab)
                trace = write_step_trace(logs / "load-step.csv", probe.sustained_rps)
            config = bench_config(worker.url, vocab, trace=trace)
            with polled_steps(worker) as samples:
                result = run_benchmark(config)
        step_at = result.started_at + LOAD_STEP_AT_S
        recovery[label] = steps_to_recover(samples, step_at)
        windows[label] = window_p99_itl_ms(result)
        _, steps, over = samples[-1]
        row = Run("mixed, load step", label, result.metrics.overall, steps, over).row()
        print(row, flush=True)
        rows.append(row)
    static = statics[0]
    assert probe is not None
    capacity = probe.sustained_rps
    rates = (LOAD_BEFORE * capacity, LOAD_AFTER * capacity)
    table = [
        {
            "window_s": f"{i * WINDOW_S:g}-{(i + 1) * WINDOW_S:g}",
            "rate": rates[i * WINDOW_S >= LOAD_STEP_AT_S],
            **{f"itl_p99_ms_{budget}": values[i] for budget, values in windows.items()},
        }
        for i in range(int(LOAD_DURATION_S / WINDOW_S))
    ]
    goodputs = {row["budget"]: row["goodput_rps"] for row in rows}
    publish(
        "token_budget_load_step",
        table,
        {
            "runs": rows,
            "static_capacity_rps": capacity,
            "capacity_probe": probe.row(),
            "rates_rps": rates,
            "goodput_adaptive_over_static": goodputs[ADAPTIVE] / goodputs[static]
            if goodputs[static]
            else None,
            # Each adaptive run over the static run before it.
            "goodput_adaptive_over_each_static": {
                f"{label} / {before}": goodputs[label] / goodputs[before]
                if goodputs[before]
                else None
                for label, before in pairs.items()
            },
            "steps_to_recover": recovery,
            "recovery_window_steps": RECOVERY_WINDOW_STEPS,
            "target_itl_ms": TARGET_ITL_MS,
            "static_budget": static,
            "static_budgets": list(statics),
        },
    )


@dataclass(frozen=True)
class Capacity:
    """What the capacity probe read (see the load step's constants)."""

    requests_per_s: float  # the probe's requests over its span
    tokens_per_s: float  # their prompt and output tokens over its span
    sustained_rps: float  # tokens_per_s in the mixed workload's average requests

    def row(self) -> dict[str, float]:
        return {
            "probe_requests_per_s": self.requests_per_s,
            "probe_tokens_per_s": self.tokens_per_s,
            "sustained_rps": self.sustained_rps,
        }


def measure_capacity(url: str, vocab: int) -> Capacity:
    """What a worker serves flat out: CAPACITY_REQUESTS mixed requests sent at once,
    over the time until the last one ends; the rate the load step is set against counts
    their tokens, not the requests (a few dozen requests are not the workload's
    average)."""
    config = bench_config(
        url, vocab, workload="mixed", rate=math.inf, num_requests=CAPACITY_REQUESTS
    )
    result = run_benchmark(config)
    served = [record for record in result.records if record.ok and record.ended_at]
    assert served, "no request of the capacity probe was served"
    span = max(record.ended_at or 0.0 for record in served) - result.started_at
    tokens = sum(record.input_tokens + sum(record.chunk_tokens) for record in served)
    return Capacity(
        len(served) / span,
        tokens / span,
        tokens / span / workload_named("mixed").mean_tokens(),
    )


def write_step_trace(path: Path, capacity: float) -> Path:
    """A trace in the Azure CSV format: mixed requests at LOAD_BEFORE x `capacity`,
    LOAD_AFTER x from LOAD_STEP_AT_S on."""
    rng = np.random.default_rng(21)
    workload = workload_named("mixed")
    start = datetime(2024, 1, 1)
    now = 0.0
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        while now < LOAD_DURATION_S:
            _, prompt, output = workload.sample(rng, None, None)
            writer.writerow([(start + timedelta(seconds=now)).isoformat(), prompt, output])
            share = LOAD_AFTER if now >= LOAD_STEP_AT_S else LOAD_BEFORE
            now += float(rng.exponential(1.0 / (share * capacity)))
    return path


Sample = tuple[float, float, float]  # perf_counter, steps so far, steps over target so far


@contextmanager
def polled_steps(worker: ServerProcess, every_s: float = 0.2) -> Iterator[list[Sample]]:
    """The worker's step counters, read every `every_s` while the block runs."""
    samples: list[Sample] = []
    done = threading.Event()

    def poll() -> None:
        while not done.wait(every_s):
            samples.append(
                (time.perf_counter(), metric(worker, STEPS), metric(worker, OVER_TARGET))
            )

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield samples
    finally:
        done.set()
        poller.join()


def steps_to_recover(samples: Sequence[Sample], step_at: float) -> int | None:
    """Engine steps from the load step until the first window of at least
    RECOVERY_WINDOW_STEPS steps with at most 1% of them over the target (P99 ITL back
    under it); None if none did."""
    after = [s for s in samples if s[0] >= step_at]
    if not after:
        return None
    for i, (_, steps, over) in enumerate(after):
        end = next((s for s in after[i:] if s[1] - steps >= RECOVERY_WINDOW_STEPS), None)
        if end is None:
            return None
        if (end[2] - over) <= 0.01 * (end[1] - steps):
            return int(steps - after[0][1])
    return None


def window_p99_itl_ms(result: BenchResult) -> list[float | None]:
    """P99 of the ITL gaps ending in each WINDOW_S window of the run."""
    gaps: list[tuple[float, float]] = []
    for record in result.records:
        if record.ok:
            times = token_times(record)
            gaps += [
                (later - result.started_at, later - earlier) for earlier, later in pairwise(times)
            ]
    out: list[float | None] = []
    for i in range(int(LOAD_DURATION_S / WINDOW_S)):
        inside = [gap for at, gap in gaps if i * WINDOW_S <= at < (i + 1) * WINDOW_S]
        out.append(float(np.percentile(inside, 99)) * 1e3 if inside else None)
    return out
