"""The client and runner against a scripted streaming server on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from itertools import pairwise
from pathlib import Path

import pytest

from pdserve.workers.bench.client import ServerError
from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.fake_server import FakeServerSpec, start
from pdserve.workers.bench.metrics import SLO
from pdserve.workers.bench.runner import arun_benchmark
from support.network import refusing_url

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def serving(spec: FakeServerSpec) -> AsyncIterator[str]:
    runner, url = await start(spec)
    try:
        yield url
    finally:
        await runner.cleanup()


def write_trace(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:00:{offset:010.7f},{ctx},{gen}" for offset, ctx, gen in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_timings_follow_the_server_and_a_400_counts_as_failed(tmp_path: Path) -> None:
    spec = FakeServerSpec(ttft_s=0.05, prefill_s_per_token=1e-5, itl_s=0.02, max_prompt_tokens=1000)
    trace = write_trace(
        tmp_path / "t.csv", [(0.0, 100, 10), (0.1, 200, 10), (0.2, 5000, 10), (0.3, 50, 1)]
    )
    async with serving(spec) as url:
        result = await arun_benchmark(
            BenchConfig(url, trace=trace, slo=SLO(ttft_ms=5000), drain_timeout_s=10)
        )
    assert result.model == "fake-model"  # found at /v1/models
    overall = result.metrics.overall
    assert (overall.requests, overall.succeeded, overall.failed) == (4, 3, 1)
    refused = result.records[2]
    assert refused.status == 400 and not refused.ok
    assert refused.error is not None and "prompt has 5000 tokens" in refused.error
    # Sent on the trace's schedule, in order (never early; a busy machine may be late).
    sends = [r.sent_at - result.started_at for r in result.records if r.sent_at is not None]
    assert sends == sorted(sends) and len(sends) == 4
    assert all(sent >= due - 1e-3 for sent, due in zip(sends, (0.0, 0.1, 0.2, 0.3), strict=True))
    # TTFT includes the server's first-token delay and its prefill time.
    for record in (result.records[0], result.records[1]):
        ttft = record.chunk_times[0] - (record.sent_at or 0.0)
        assert ttft >= 0.05 + record.input_tokens * 1e-5
    # ITL: every gap of every request, pooled: 9 + 9 + 0 gaps. (Each gap's length is
    # the machine's business: a busy client reads two chunks at once.) The server spent
    # at least 9 gaps of 20 ms after the first-token delay.
    assert overall.itl is not None and overall.tpot is not None and overall.e2e is not None
    assert overall.itl.count == 18
    for record in (result.records[0], result.records[1]):
        assert record.chunk_times[-1] - (record.sent_at or 0.0) >= 0.05 + 9 * 0.02
    assert overall.tpot.count == 2  # the one-token request has no TPOT
    assert overall.output_tokens == 21
    assert overall.slo_attainment == pytest.approx(0.75)  # the refused request misses


async def test_chunks_with_several_tokens(tmp_path: Path) -> None:
    spec = FakeServerSpec(ttft_s=0.01, itl_s=0.03, tokens_per_chunk=4)
    trace = write_trace(tmp_path / "t.csv", [(0.0, 64, 12), (0.0, 64, 12)])
    async with serving(spec) as url:
        result = await arun_benchmark(BenchConfig(url, trace=trace, model="m"))
    itl = [g for r in result.records for g in _gaps(r.chunk_times)]
    overall = result.metrics.overall
    assert overall.output_tokens == 24  # from usage, though only 3 chunks each had text
    assert overall.itl is not None and overall.itl.count == 22
    assert overall.itl.p50 == 0.0  # 18 of the 22 gaps are inside chunks
    assert overall.itl.max == pytest.approx(max(itl))
    # The server spent two 30 ms gaps between each request's three chunks.
    assert all(r.chunk_times[-1] - (r.sent_at or 0.0) >= 0.01 + 2 * 0.03 for r in result.records)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in pairwise(times)]


async def test_a_stuck_request_is_cut_at_the_drain_deadline(tmp_path: Path) -> None:
    spec = FakeServerSpec(itl_s=1.0)
    trace = write_trace(tmp_path / "t.csv", [(0.0, 10, 100)])
    async with serving(spec) as url:
        result = await arun_benchmark(
            BenchConfig(url, trace=trace, model="m", duration_s=0.1, drain_timeout_s=0.5)
        )
    record = result.records[0]
    assert not record.ok and record.error == "unfinished at the drain deadline"
    assert record.chunk_times  # it was streaming when cut
    assert result.metrics.overall.failed == 1


async def test_concurrency_limit_holds_requests_back(tmp_path: Path) -> None:
    spec = FakeServerSpec(ttft_s=0.05, itl_s=0.01)
    trace = write_trace(tmp_path / "t.csv", [(0.0, 10, 5)] * 3)
    async with serving(spec) as url:
        result = await arun_benchmark(BenchConfig(url, trace=trace, model="m", concurrency_limit=1))
    records = sorted(result.records, key=lambda r: r.sent_at or 0.0)
    assert all(r.ok for r in records)
    for earlier, later in pairwise(records):
        assert (later.sent_at or 0.0) >= (earlier.chunk_times[-1])


async def test_unreachable_server() -> None:
    with refusing_url() as url:
        with pytest.raises(ServerError, match="cannot reach"):
            await arun_benchmark(BenchConfig(url, workload="chat", num_requests=2))
        # With the model named, each request fails and is counted, none is dropped.
        result = await arun_benchmark(
            BenchConfig(url, workload="chat", num_requests=2, rate=50.0, model="m")
        )
    assert result.metrics.overall.failed == 2
    assert all(r.error and r.error.startswith("ClientConnectorError") for r in result.records)
