"""Latency, throughput and goodput from request records.

The definitions are the project's (docs/architecture.md, "Metric definitions"):
- TTFT: request sent -> first token received.
- ITL: every gap between consecutive streamed tokens, pooled across requests. A
  chunk carrying k > 1 tokens counts as k tokens: the gap before it is real, the
  k - 1 gaps inside it are 0.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1), for requests with at least
  two output tokens.
- E2E: request sent -> last token.
- Goodput: requests per second that meet every SLO given (TTFT, TPOT, E2E and, when
  an ITL SLO is given, every ITL gap of the request); SLO attainment is the same
  count as a fraction of all requests sent, failures included.
Latency figures cover successful requests only; a failed request counts as sent,
failed and not meeting the SLOs. Throughput and goodput divide by the run's
duration: from the start to the end of the last request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.workers.bench.records import RequestRecord

# Upper bounds (inclusive) of the input-length buckets; one more bucket holds the rest.
DEFAULT_BUCKETS: tuple[int, ...] = (256, 1024, 4096)


@dataclass(frozen=True)
class SLO:
    """Latency targets in milliseconds; None means no target on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def given(self) -> bool:
        """At least one target is set."""
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.itl_ms, self.e2e_ms))

    def describe(self) -> str:
        """The targets in words, e.g. `TTFT<=500ms, TPOT<=50ms`."""
        named = (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("ITL", self.itl_ms))
        parts = [f"{name}<={value:g}ms" for name, value in named if value is not None]
        if self.e2e_ms is not None:
            parts.append(f"E2E<={self.e2e_ms:g}ms")
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class Distribution:
    """Summary of a sample, in the sample's unit (seconds for latencies)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float


def summarize(values: Sequence[float] | np.ndarray) -> Distribution | None:
    """Mean, percentiles (linear interpolation) and max; None for an empty sample."""
    array = np.asarray(values, dtype=float)
    if array.size == 0:
        return None
    p50, p95, p99 = np.percentile(array, [50, 95, 99])
    return Distribution(
        int(array.size), float(array.mean()), float(p50), float(p95), float(p99), float(array.max())
    )


@dataclass(frozen=True)
class RequestLatency:
    """The latency figures of one successful request, in seconds."""

    output_tokens: int
    ttft_s: float
    e2e_s: float
    tpot_s: float | None
    # An array, not a tuple: a long trace replay pools millions of gaps.
    itl_s: np.ndarray = field(compare=False)

    @property
    def max_itl_s(self) -> float | None:
        """The longest gap between two tokens (None with fewer than two tokens)."""
        return float(self.itl_s.max()) if self.itl_s.size else None


def token_times(record: RequestRecord) -> list[float]:
    """The arrival time of every output token, chunks expanded to their token counts.

    When the final usage reports more tokens than the chunks showed (a server that
    coalesced tokens without saying how many), the extra tokens are placed at the
    last chunk: they add zero gaps, which is what they are wherever they belong, so
    the pooled ITL distribution is exact.
    """
    times: list[float] = []
    for when, count in zip(record.chunk_times, record.chunk_tokens, strict=True):
        times.extend([when] * count)
    reported = record.usage_completion_tokens
    if times and reported is not None and reported > len(times):
        times.extend([times[-1]] * (reported - len(times)))
    return times


def request_latency(record: RequestRecord) -> RequestLatency | None:
    """TTFT, E2E, TPOT and ITL gaps of a successful request; None for a failed one."""
    if not record.ok or record.sent_at is None:
        return None
    times = token_times(record)
    ttft = times[0] - record.sent_at
    e2e = times[-1] - record.sent_at
    tokens = len(times)
    tpot = (e2e - ttft) / (tokens - 1) if tokens >= 2 else None
    return RequestLatency(tokens, ttft, e2e, tpot, np.diff(np.asarray(times)))


def meets_slo(latency: RequestLatency | None, slo: SLO) -> bool:
    """Whether a request met every target given (a failed request never does).

    A request with a single output token has no TPOT and no ITL gap: it cannot miss
    those targets.
    """
    if latency is None:
        return False
    checks = (
        (slo.ttft_ms, latency.ttft_s),
        (slo.e2e_ms, latency.e2e_s),
        (slo.tpot_ms, latency.tpot_s),
        (slo.itl_ms, latency.max_itl_s),
    )
    return all(
        target is None or value is None or value * 1000.0 <= target for target, value in checks
    )


@dataclass(frozen=True)
class GroupMetrics:
    """Figures for a group of requests (all of them, or one input-length bucket)."""

    requests: int
    succeeded: int
    failed: int
    input_tokens: int
    output_tokens: int
    ttft: Distribution | None
    itl: Distribution | None
    tpot: Distribution | None
    e2e: Distribution | None
    request_throughput: float
    output_throughput: float
    total_throughput: float
    good_requests: int | None
    goodput: float | None
    slo_attainment: float | None


@dataclass(frozen=True)
class BenchMetrics:
    """Every figure of a run: overall, per input-length bucket, per bucket and the mode
    the server served in (when it says, as pdserve's router does), and the
    generator's lag."""

    duration_s: float
    overall: GroupMetrics
    buckets: dict[str, GroupMetrics]
    send_lag: Distribution | None
    errors: dict[str, int]
    modes: dict[str, dict[str, GroupMetrics]] = field(default_factory=dict)


def bucket_labels(bounds: Sequence[int]) -> list[str]:
    """Labels of the buckets, e.g. `<=256`, `<=1024`, `>1024`."""
    return [f"<={bound}" for bound in bounds] + [f">{bounds[-1]}"]


def bucket_label(input_tokens: int, bounds: Sequence[int]) -> str:
    """The label of the bucket holding a prompt of `input_tokens` tokens."""
    for bound in bounds:
        if input_tokens <= bound:
            return f"<={bound}"
    return f">{bounds[-1]}"


def compute_metrics(
    records: Sequence[RequestRecord],
    started_at: float,
    slo: SLO,
    bounds: Sequence[int] = DEFAULT_BUCKETS,
) -> BenchMetrics:
    """All figures of a run whose clock (perf_counter) started at `started_at`."""
    ends = [r.ended_at for r in records if r.ended_at is not None]
    duration = max(ends) - started_at if ends else 0.0
    latencies = [request_latency(r) for r in records]
    pairs = list(zip(records, latencies, strict=True))
    buckets = {
        label: _group(
            [p for p in pairs if bucket_label(p[0].input_tokens, bounds) == label], slo, duration
        )
        for label in bucket_labels(bounds)
    }
    lags = [r.sent_at - r.scheduled_at for r in records if r.sent_at is not None]
    errors = Counter(r.error for r in records if r.error is not None)
    return BenchMetrics(
        duration,
        _group(pairs, slo, duration),
        buckets,
        summarize(lags),
        dict(errors.most_common()),
        _by_mode(pairs, slo, duration, bounds),
    )


def _by_mode(
    pairs: Sequence[tuple[RequestRecord, RequestLatency | None]],
    slo: SLO,
    duration: float,
    bounds: Sequence[int],
) -> dict[str, dict[str, GroupMetrics]]:
    """Figures per bucket and serving mode, for the requests whose mode is known."""
    grouped: dict[str, dict[str, list[tuple[RequestRecord, RequestLatency | None]]]] = {}
    for record, latency in pairs:
        if record.mode is not None:
            bucket = bucket_label(record.input_tokens, bounds)
            grouped.setdefault(bucket, {}).setdefault(record.mode, []).append((record, latency))
    return {
        bucket: {mode: _group(group, slo, duration) for mode, group in sorted(modes.items())}
        for bucket in bucket_labels(bounds)
        if (modes := grouped.get(bucket))
    }


def _group(
    pairs: Sequence[tuple[RequestRecord, RequestLatency | None]], slo: SLO, duration: float
) -> GroupMetrics:
    done = [(r, lat) for r, lat in pairs if lat is not None]
    input_tokens = sum(_prompt_tokens(r) for r, _ in done)
    output_tokens = sum(lat.output_tokens for _, lat in done)
    good = sum(meets_slo(lat, slo) for _, lat in pairs) if slo.given else None
    return GroupMetrics(
        requests=len(pairs),
        succeeded=len(done),
        failed=len(pairs) - len(done),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        ttft=summarize([lat.ttft_s for _, lat in done]),
        itl=summarize(np.concatenate([lat.itl_s for _, lat in done]) if done else []),
        tpot=summarize([lat.tpot_s for _, lat in done if lat.tpot_s is not None]),
        e2e=summarize([lat.e2e_s for _, lat in done]),
        request_throughput=_rate(len(done), duration),
        output_throughput=_rate(output_tokens, duration),
        total_throughput=_rate(input_tokens + output_tokens, duration),
        good_requests=good,
        goodput=None if good is None else _rate(good, duration),
        slo_attainment=None if good is None or not pairs else good / len(pairs),
    )


def _prompt_tokens(record: RequestRecord) -> int:
    if record.usage_prompt_tokens is not None:
        return record.usage_prompt_tokens
    return record.input_tokens


def _rate(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0
