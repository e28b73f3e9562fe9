"""Bench metrics on hand-made request records with known answers."""

from __future__ import annotations

import pytest

from pdserve.workers.bench.metrics import (
    SLO,
    bucket_label,
    compute_metrics,
    request_latency,
    token_times,
)
from pdserve.workers.bench.records import RequestRecord


def record(
    index: int,
    sent: float,
    chunks: list[tuple[float, int]],
    input_tokens: int = 100,
    usage: int | None = None,
    error: str | None = None,
) -> RequestRecord:
    """A finished request sent at `sent` whose chunks arrived at the given times."""
    rec = RequestRecord(index, "test", input_tokens, 16, scheduled_at=sent, sent_at=sent)
    rec.chunk_times = [t for t, _ in chunks]
    rec.chunk_tokens = [k for _, k in chunks]
    rec.usage_completion_tokens = usage
    rec.ended_at = chunks[-1][0] if chunks else sent + 0.01
    if error is None:
        rec.finished = True
    else:
        rec.error = error
    return rec


# Request A: one token per chunk. TTFT 1.0, gaps 0.1 and 0.2, E2E 1.3, TPOT 0.15.
A = [(1.0, 1), (1.1, 1), (1.3, 1)]
# Request B: the last chunk carries 3 tokens. TTFT 0.5, gaps 0.4, 0, 0; TPOT 0.4/3.
B = [(10.5, 1), (10.9, 3)]


def test_single_request_figures() -> None:
    latency = request_latency(record(0, 0.0, A))
    assert latency is not None
    assert latency.ttft_s == pytest.approx(1.0)
    assert latency.e2e_s == pytest.approx(1.3)
    assert latency.tpot_s == pytest.approx(0.15)
    assert list(latency.itl_s) == pytest.approx([0.1, 0.2])


def test_chunk_with_several_tokens_counts_zero_gaps_inside() -> None:
    latency = request_latency(record(0, 10.0, B))
    assert latency is not None
    assert latency.output_tokens == 4
    assert list(latency.itl_s) == pytest.approx([0.4, 0.0, 0.0])
    assert latency.tpot_s == pytest.approx(0.4 / 3)


def test_usage_beyond_visible_chunks_adds_zero_gaps() -> None:
    # Two chunks with text, but the server reports 4 tokens: two came silently.
    rec = record(0, 0.0, [(0.2, 1), (0.5, 1)], usage=4)
    assert token_times(rec) == [0.2, 0.5, 0.5, 0.5]
    latency = request_latency(rec)
    assert latency is not None
    assert sorted(latency.itl_s) == pytest.approx([0.0, 0.0, 0.3])
    assert latency.tpot_s == pytest.approx(0.3 / 3)


def test_itl_is_pooled_across_requests() -> None:
    metrics = compute_metrics([record(0, 0.0, A), record(1, 10.0, B)], 0.0, SLO())
    itl = metrics.overall.itl
    assert itl is not None
    assert itl.count == 5  # (3 - 1) + (4 - 1): every gap, not one figure per request
    assert itl.mean == pytest.approx((0.1 + 0.2 + 0.4) / 5)
    assert itl.p50 == pytest.approx(0.1)
    assert itl.max == pytest.approx(0.4)


def test_tpot_only_for_requests_with_two_tokens_or_more() -> None:
    one_token = record(2, 0.0, [(0.3, 1)])
    metrics = compute_metrics([record(0, 0.0, A), one_token], 0.0, SLO())
    assert metrics.overall.tpot is not None
    assert metrics.overall.tpot.count == 1
    assert metrics.overall.ttft is not None and metrics.overall.ttft.count == 2


def test_throughput_over_the_run_duration() -> None:
    metrics = compute_metrics([record(0, 0.0, A), record(1, 10.0, B)], 0.0, SLO())
    assert metrics.duration_s == pytest.approx(10.9)
    overall = metrics.overall
    assert overall.request_throughput == pytest.approx(2 / 10.9)
    assert overall.output_throughput == pytest.approx(7 / 10.9)
    assert overall.total_throughput == pytest.approx((200 + 7) / 10.9)
    assert overall.goodput is None and overall.slo_attainment is None  # no SLO given


def slo_case() -> list[RequestRecord]:
    """Four requests: fast; slow first token; one long stall; failed."""
    fast = record(0, 0.0, [(0.1, 1), (0.15, 1), (0.2, 1), (0.25, 1)])
    slow_first = record(1, 0.0, [(0.9, 1), (0.95, 1), (1.0, 1)])
    # Mean TPOT is 0.1 s but one gap is 0.25 s.
    stall = record(2, 0.0, [(0.1, 1), (0.35, 1), (0.375, 1), (0.4, 1)])
    failed = record(3, 0.0, [], error="HTTP 400: prompt too long")
    return [fast, slow_first, stall, failed]


def test_goodput_counts_requests_meeting_ttft_and_tpot() -> None:
    metrics = compute_metrics(slo_case(), 0.0, SLO(ttft_ms=500, tpot_ms=120))
    overall = metrics.overall
    assert overall.good_requests == 2  # fast and stall; slow_first misses TTFT
    assert overall.goodput == pytest.approx(2 / metrics.duration_s)
    assert overall.slo_attainment == pytest.approx(2 / 4)  # the failure counts as a miss


def test_itl_slo_applies_to_every_gap_of_a_request() -> None:
    metrics = compute_metrics(slo_case(), 0.0, SLO(ttft_ms=500, tpot_ms=120, itl_ms=100))
    assert metrics.overall.good_requests == 1  # the stall's 250 ms gap misses now
    assert metrics.overall.slo_attainment == pytest.approx(1 / 4)


def test_failed_requests_are_counted_not_measured() -> None:
    metrics = compute_metrics(slo_case(), 0.0, SLO())
    overall = metrics.overall
    assert (overall.requests, overall.succeeded, overall.failed) == (4, 3, 1)
    assert overall.ttft is not None and overall.ttft.count == 3
    assert metrics.errors == {"HTTP 400: prompt too long": 1}


def test_bucket_split_by_input_length() -> None:
    records = [
        record(0, 0.0, A, input_tokens=256),
        record(1, 0.0, A, input_tokens=257),
        record(2, 0.0, [(3.0, 1), (3.1, 1)], input_tokens=3000),
        record(3, 0.0, [(5.0, 1)], input_tokens=5000),
        record(4, 0.0, [], input_tokens=6000, error="HTTP 400: too long"),
    ]
    metrics = compute_metrics(records, 0.0, SLO(ttft_ms=2000))
    buckets = metrics.buckets
    assert list(buckets) == ["<=256", "<=1024", "<=4096", ">4096"]
    assert [b.requests for b in buckets.values()] == [1, 1, 1, 2]
    assert buckets[">4096"].failed == 1
    long = buckets["<=4096"]
    assert long.ttft is not None and long.ttft.p50 == pytest.approx(3.0)
    assert long.slo_attainment == 0.0
    assert buckets["<=256"].slo_attainment == 1.0
    assert buckets[">4096"].slo_attainment == pytest.approx(0.0)
    # The buckets partition the run: their throughputs add up to the overall one.
    total = sum(b.output_throughput for b in buckets.values())
    assert total == pytest.approx(metrics.overall.output_throughput)


def test_bucket_label_bounds_are_inclusive() -> None:
    bounds = (256, 1024, 4096)
    assert bucket_label(1, bounds) == "<=256"
    assert bucket_label(1024, bounds) == "<=1024"
    assert bucket_label(1025, bounds) == "<=4096"
    assert bucket_label(4097, bounds) == ">4096"


def test_send_lag_is_measured_from_the_schedule() -> None:
    late = record(0, 0.0, A)
    late.scheduled_at = -0.004
    metrics = compute_metrics([late], -0.004, SLO())
    assert metrics.send_lag is not None
    assert metrics.send_lag.max == pytest.approx(0.004)


def test_figures_per_bucket_and_mode_served() -> None:
    short = record(0, 0.0, A, input_tokens=100)
    short.mode = "colocated"
    long_ones = [record(i, 0.0, B, input_tokens=2000) for i in (1, 2, 3)]
    long_ones[0].mode = long_ones[1].mode = "disaggregated"
    long_ones[2].mode = "colocated"  # a fallback
    unknown = record(4, 0.0, A, input_tokens=100)  # a server that does not say
    metrics = compute_metrics([short, *long_ones, unknown], 0.0, SLO(ttft_ms=800), (512,))
    assert {b: {m: g.requests for m, g in modes.items()} for b, modes in metrics.modes.items()} == {
        "<=512": {"colocated": 1},
        ">512": {"colocated": 1, "disaggregated": 2},
    }
    disaggregated = metrics.modes[">512"]["disaggregated"]
    assert disaggregated.ttft is not None and disaggregated.ttft.p50 == pytest.approx(10.5)
    assert metrics.buckets["<=512"].requests == 2
