"""Reports of a run: a printed table, a JSON document and a PNG plot.

Printed figures are in milliseconds; JSON figures are in base units (seconds,
tokens, requests per second), like the project's Prometheus metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
from itertools import pairwise
from pathlib import Path
from typing import Any

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.metrics import (
    BenchMetrics,
    Distribution,
    GroupMetrics,
    RequestLatency,
    meets_slo,
    request_latency,
    token_times,
)
from pdserve.workers.bench.prefix_workloads import prefix_figures
from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.bench.runner import BenchResult

# Requests whose prompt is longer than this are marked on the ITL plot: their
# prefill is what stalls the other streams.
LONG_PROMPT_TOKENS = 1024
# A P99 send lag above this means arrivals were visibly not the ones asked for
# (timer wake-ups alone cost about a millisecond).
_LAG_WARNING_S = 0.025


def format_report(result: BenchResult) -> str:
    """The human-readable summary: headline figures, latency table, buckets."""
    config, metrics = result.config, result.metrics
    overall = metrics.overall
    lines = [
        f"pdserve bench: {config.source} against {config.url} (model {result.model})",
        _traffic_line(result),
        f"requests: {overall.requests} sent, {overall.succeeded} ok, {overall.failed} failed; "
        f"duration {metrics.duration_s:.1f} s",
        f"throughput: {overall.request_throughput:.2f} req/s, "
        f"{overall.output_throughput:.1f} output tok/s, {overall.total_throughput:.1f} total tok/s",
        _goodput_line(overall, config.slo.describe()),
        *_prefix_lines(result),
        "",
        *_latency_table(overall),
        "",
        *_bucket_table(metrics),
        *_error_lines(metrics),
        *_generator_lines(result),
    ]
    return "\n".join(lines)


def _prefix_share(config: BenchConfig) -> str:
    share = config.trace_prefix_share
    return "" if share is None else f", {share:g} of its prefix groups (seed {config.seed})"


def _traffic_line(result: BenchResult) -> str:
    config = result.config
    if config.trace is not None:
        return (
            f"traffic: trace replay, time x{config.trace_time_scale:g}, "
            f"lengths x{config.trace_length_scale:g}" + _prefix_share(config)
        )
    shape = config.arrival if config.arrival == "poisson" else f"gamma CV {config.burstiness:g}"
    limit = f", at most {config.concurrency_limit} in flight" if config.concurrency_limit else ""
    return f"traffic: {shape} arrivals at {config.rate:g} req/s, seed {config.seed}{limit}"


def _prefix_lines(result: BenchResult) -> list[str]:
    figures = prefix_figures(result.records)
    if figures is None:
        return []
    return [
        f"prefix cache: {figures.cached_tokens} of {figures.prompt_tokens} prompt tokens "
        f"found cached ({figures.hit_rate:.1%}, the servers' own count)"
    ]


def _goodput_line(group: GroupMetrics, slo_text: str) -> str:
    if group.goodput is None or group.slo_attainment is None:
        return "goodput: no SLO given (--slo-ttft-ms, --slo-tpot-ms, --slo-itl-ms)"
    return (
        f"goodput: {group.goodput:.2f} req/s meet every SLO ({slo_text}); "
        f"SLO attainment {100 * group.slo_attainment:.1f}%"
    )


def _latency_table(group: GroupMetrics) -> list[str]:
    header = f"{'metric (ms)':<12}{'mean':>10}{'P50':>10}{'P95':>10}{'P99':>10}{'max':>10}{'n':>9}"
    rows = [header]
    for name, dist in (
        ("TTFT", group.ttft),
        ("ITL", group.itl),
        ("TPOT", group.tpot),
        ("E2E", group.e2e),
    ):
        if dist is None:
            rows.append(f"{name:<12}{'-':>10}{'-':>10}{'-':>10}{'-':>10}{'-':>10}{0:>9}")
            continue
        figures = (dist.mean, dist.p50, dist.p95, dist.p99, dist.max)
        rows.append(
            f"{name:<12}" + "".join(f"{1000 * v:>10.1f}" for v in figures) + f"{dist.count:>9}"
        )
    return rows


_GROUP_HEADER = (
    f"{'req':>6}{'fail':>6}{'TTFT P50':>10}{'TTFT P99':>10}{'ITL P50':>9}{'ITL P99':>9}"
    f"{'TPOT P50':>10}{'TPOT P99':>10}{'E2E P50':>10}{'goodput':>9}{'attain':>8}"
)


def _bucket_table(metrics: BenchMetrics) -> list[str]:
    rows = [
        "per input-length bucket (tokens; latencies in ms)",
        f"{'bucket':<9}" + _GROUP_HEADER,
    ]
    for label, group in metrics.buckets.items():
        if group.requests:
            rows.append(f"{label:<9}" + _group_row(group))
    if metrics.modes:
        rows += ["", "per bucket and mode served", f"{'bucket':<9}{'mode':<15}" + _GROUP_HEADER]
        for label, modes in metrics.modes.items():
            for mode, group in modes.items():
                rows.append(f"{label:<9}{mode:<15}" + _group_row(group))
    return rows


def _group_row(group: GroupMetrics) -> str:
    return (
        f"{group.requests:>6}{group.failed:>6}"
        f"{_ms(group.ttft, 'p50'):>10}{_ms(group.ttft, 'p99'):>10}"
        f"{_ms(group.itl, 'p50'):>9}{_ms(group.itl, 'p99'):>9}"
        f"{_ms(group.tpot, 'p50'):>10}{_ms(group.tpot, 'p99'):>10}"
        f"{_ms(group.e2e, 'p50'):>10}{_optional(group.goodput, '{:.2f}'):>9}"
        f"{_optional(group.slo_attainment, '{:.1%}'):>8}"
    )


def _ms(dist: Distribution | None, field: str) -> str:
    return "-" if dist is None else f"{1000 * getattr(dist, field):.1f}"


def _optional(value: float | None, template: str) -> str:
    return "-" if value is None else template.format(value)


def _error_lines(metrics: BenchMetrics) -> list[str]:
    if not metrics.errors:
        return []
    lines = ["", "failures (count: reason)"]
    lines += [f"{count:>6}: {message}" for message, count in list(metrics.errors.items())[:5]]
    if len(metrics.errors) > 5:
        lines.append(f"   ... and {len(metrics.errors) - 5} other reasons (see the JSON)")
    return lines


def _generator_lines(result: BenchResult) -> list[str]:
    duration = result.metrics.duration_s
    share = result.generator_cpu_s / duration if duration > 0 else 0.0
    lines = ["", f"generator: CPU {result.generator_cpu_s:.2f} s ({share:.1%} of one core)"]
    lag = result.metrics.send_lag
    if lag is None:
        return lines
    lines[-1] += (
        f"; send lag behind schedule P50 {1000 * lag.p50:.2f} ms, "
        f"P99 {1000 * lag.p99:.2f} ms, max {1000 * lag.max:.2f} ms"
    )
    if lag.p99 > _LAG_WARNING_S:
        why = (
            "they waited for a concurrency slot"
            if result.config.concurrency_limit
            else "the generator or this machine's CPU fell behind"
        )
        lines.append(f"warning: requests left late ({why}): arrivals were not the ones asked for")
    return lines


def result_json(result: BenchResult) -> dict[str, Any]:
    """Every figure of the run, its configuration and one summary row per request."""
    metrics = result.metrics
    figures = prefix_figures(result.records)
    return {
        "config": _jsonable(dataclasses.asdict(result.config)),
        "model": result.model,
        "started_at": result.wall_start.isoformat(),
        "duration_s": metrics.duration_s,
        "overall": _jsonable(dataclasses.asdict(metrics.overall)),
        "buckets": {k: _jsonable(dataclasses.asdict(g)) for k, g in metrics.buckets.items()},
        "modes": {
            bucket: {mode: _jsonable(dataclasses.asdict(g)) for mode, g in modes.items()}
            for bucket, modes in metrics.modes.items()
        },
        "generator": {
            "cpu_s": result.generator_cpu_s,
            "send_lag_s": dataclasses.asdict(metrics.send_lag) if metrics.send_lag else None,
        },
        "errors": metrics.errors,
        "prefix": _jsonable(dataclasses.asdict(figures)) if figures else None,
        "requests": [_request_row(result, record) for record in result.records],
    }


def _request_row(result: BenchResult, record: RequestRecord) -> dict[str, Any]:
    latency = request_latency(record)
    row: dict[str, Any] = {
        "index": record.index,
        "kind": record.kind,
        "scheduled_s": record.scheduled_at - result.started_at,
        "send_lag_s": None if record.sent_at is None else record.sent_at - record.scheduled_at,
        "input_tokens": record.input_tokens,
        "requested_output_tokens": record.requested_output_tokens,
        "ok": record.ok,
        "status": record.status,
        "mode": record.mode,
        "error": record.error,
        "chunks": len(record.chunk_times),
        "prompt_tokens": record.usage_prompt_tokens,
        "cached_tokens": record.usage_cached_tokens,
    }
    row.update(_latency_row(latency, result))
    return row


def _latency_row(latency: RequestLatency | None, result: BenchResult) -> dict[str, Any]:
    if latency is None:
        return {"output_tokens": None, "meets_slo": False if result.config.slo.given else None}
    return {
        "output_tokens": latency.output_tokens,
        "ttft_s": latency.ttft_s,
        "e2e_s": latency.e2e_s,
        "tpot_s": latency.tpot_s,
        "itl_max_s": latency.max_itl_s,
        "meets_slo": meets_slo(latency, result.config.slo) if result.config.slo.given else None,
    }


def _jsonable(value: Any) -> Any:
    """Paths as strings, non-finite floats as strings (JSON has no Infinity)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(result: BenchResult, path: Path) -> None:
    """Write `result_json` to `path`."""
    path.write_text(json.dumps(result_json(result), indent=1) + "\n")


def write_plot(
    result: BenchResult, path: Path, long_prompt_tokens: int = LONG_PROMPT_TOKENS
) -> None:
    """A PNG: ITL over time with long-prompt arrivals marked, and TTFT against prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (itl_axes, ttft_axes) = plt.subplots(2, 1, figsize=(11, 8), layout="constrained")
    _plot_itl(itl_axes, result, long_prompt_tokens)
    _plot_ttft(ttft_axes, result)
    figure.suptitle(f"pdserve bench: {result.config.source}, model {result.model}")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_itl(axes: Any, result: BenchResult, long_prompt_tokens: int) -> None:
    times: list[float] = []
    gaps: list[float] = []
    for record in result.records:
        if not record.ok:
            continue
        stamps = token_times(record)
        for before, after in pairwise(stamps):
            times.append(after - result.started_at)
            gaps.append(1000 * (after - before))
    axes.scatter(times, gaps, s=2, alpha=0.5, label="ITL gap")
    long_sends = [
        r.sent_at - result.started_at
        for r in result.records
        if r.sent_at is not None and r.input_tokens > long_prompt_tokens
    ]
    for index, when in enumerate(long_sends):
        axes.axvline(
            when,
            color="tab:red",
            alpha=0.3,
            linewidth=1,
            label=f"prompt > {long_prompt_tokens} tokens sent" if index == 0 else None,
        )
    axes.set_xlabel("time since start (s)")
    axes.set_ylabel("ITL (ms)")
    axes.set_title("inter-token latency over time")
    if times or long_sends:
        axes.legend(loc="upper right")


def _plot_ttft(axes: Any, result: BenchResult) -> None:
    by_kind: dict[str, tuple[list[int], list[float]]] = {}
    for record in result.records:
        latency = request_latency(record)
        if latency is not None:
            tokens, ttfts = by_kind.setdefault(record.kind, ([], []))
            tokens.append(record.input_tokens)
            ttfts.append(1000 * latency.ttft_s)
    for kind, (tokens, ttfts) in sorted(by_kind.items()):
        axes.scatter(tokens, ttfts, s=8, alpha=0.6, label=kind)
    if by_kind:
        axes.legend(loc="upper left")
    axes.set_xlabel("prompt length (tokens)")
    axes.set_ylabel("TTFT (ms)")
    axes.set_title("time to first token against prompt length")
