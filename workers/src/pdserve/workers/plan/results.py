"""What a simulation reports: the figures `pdserve bench` computes from its records
(goodput, SLO attainment, per bucket and mode), and latency percentiles per
input-length bucket at the percentiles a pool's SLO names."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.protocol.routing import Slo
from pdserve.workers.bench.metrics import (
    SLO,
    RequestLatency,
    bucket_label,
    bucket_labels,
    compute_metrics,
    request_latency,
)
from pdserve.workers.bench.records import RequestRecord

Percentiles = dict[str, float]
# The figures of a run whose spread across draws a prediction reports beside their mean.
SPREAD_FIGURES = ("goodput", "slo_attainment", "overall", "buckets")


def slo_of(slo: Slo) -> SLO:
    """The pool's targets as the bench's goodput counts them (every gap under the ITL
    target, the first token under the TTFT target)."""
    ms = [None if s is None else s * 1000.0 for s in (slo.ttft_seconds, slo.itl_seconds)]
    return SLO(ttft_ms=ms[0], itl_ms=ms[1])


def summarize_run(
    records: Sequence[RequestRecord],
    slo: Slo,
    percentiles: Sequence[float],
    bounds: Sequence[int],
) -> dict[str, Any]:
    """Every figure of a run whose clock started at 0, as JSON-ready values."""
    metrics = compute_metrics(records, 0.0, slo_of(slo), bounds)
    latencies = [request_latency(r) for r in records]
    labelled = [
        (bucket_label(r.input_tokens, bounds), lat)
        for r, lat in zip(records, latencies, strict=True)
    ]
    overall = metrics.overall
    return {
        "duration_s": metrics.duration_s,
        "requests": overall.requests,
        "succeeded": overall.succeeded,
        "failed": overall.failed,
        "errors": metrics.errors,
        "goodput": overall.goodput,
        "slo_attainment": overall.slo_attainment,
        "output_throughput": overall.output_throughput,
        "overall": _latencies([lat for _, lat in labelled], percentiles),
        "buckets": {
            label: {
                "requests": metrics.buckets[label].requests,
                "slo_attainment": metrics.buckets[label].slo_attainment,
                **_latencies([lat for name, lat in labelled if name == label], percentiles),
            }
            for label in bucket_labels(bounds)
        },
        "modes": {
            bucket: {mode: group.requests for mode, group in modes.items()}
            for bucket, modes in metrics.modes.items()
        },
    }


def _latencies(
    latencies: Sequence[RequestLatency | None], percentiles: Sequence[float]
) -> dict[str, Percentiles | None]:
    """TTFT, ITL (every gap, pooled), TPOT and E2E of the successful requests."""
    done = [lat for lat in latencies if lat is not None]
    samples: dict[str, Sequence[float] | np.ndarray] = {
        "ttft_s": [lat.ttft_s for lat in done],
        "itl_s": np.concatenate([lat.itl_s for lat in done]) if done else np.array([]),
        "tpot_s": [lat.tpot_s for lat in done if lat.tpot_s is not None],
        "e2e_s": [lat.e2e_s for lat in done],
    }
    return {name: _percentiles(values, percentiles) for name, values in samples.items()}


def _percentiles(
    values: Sequence[float] | np.ndarray, percentiles: Sequence[float]
) -> Percentiles | None:
    array = np.asarray(values, dtype=float)
    if array.size == 0:
        return None
    figures = np.percentile(array, list(percentiles))
    return {f"p{q:g}": float(v) for q, v in zip(percentiles, figures, strict=True)}


def mean_of_draws(draws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One prediction from several draws of the same run: every figure the mean of the
    draws' (a count stays whole where every draw agrees on it; a figure none of them
    has stays None), and under "spread" the latency and goodput figures' standard
    deviation across the draws, so a reader sees how far one draw could fall.

    A mode a draw served no request of is missing from its "modes": that draw's count
    of it is 0, not unknown, so each count is the mean over every draw."""
    mean: dict[str, Any] = _mean([_with_every_mode(draw, draws) for draw in draws])
    if len(draws) > 1:
        mean["spread"] = {name: _deviation([d[name] for d in draws]) for name in SPREAD_FIGURES}
    return mean


def _with_every_mode(draw: dict[str, Any], draws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`draw` with a count of 0 for every bucket's mode another draw has and it lacks."""
    if "modes" not in draw:
        return draw
    # In the order the draws name them (a set's order would move between runs).
    buckets = dict.fromkeys(bucket for other in draws for bucket in other.get("modes", {}))
    modes = {
        bucket: {
            mode: draw["modes"].get(bucket, {}).get(mode, 0)
            for other in draws
            for mode in other.get("modes", {}).get(bucket, {})
        }
        for bucket in buckets
    }
    return {**draw, "modes": modes}


def _mean(values: list[Any]) -> Any:
    first = next((value for value in values if value is not None), None)
    if isinstance(first, dict):
        keys = {key: None for value in values if value is not None for key in value}
        known = [value for value in values if value is not None]
        return {key: _mean([value.get(key) for value in known]) for key in keys}
    numbers = [value for value in values if isinstance(value, (int, float))]
    if not numbers or any(isinstance(value, bool) for value in numbers):
        return first  # a name, a flag, or a figure no draw has
    if all(isinstance(value, int) for value in numbers) and len(set(numbers)) == 1:
        return numbers[0]
    return statistics.fmean(numbers)


def _deviation(values: list[Any]) -> Any:
    known = [value for value in values if value is not None]
    if not known:
        return None
    if isinstance(known[0], dict):
        keys = {key: None for value in known for key in value}
        return {key: _deviation([value.get(key) for value in known]) for key in keys}
    numbers = [float(value) for value in known if isinstance(value, (int, float))]
    return statistics.pstdev(numbers) if numbers else None
