"""How fast the load generator can record streamed tokens: it must not be the bottleneck.

The fake server runs in its own process with no delays and streams one token per
chunk; the generator's process CPU time per recorded token bounds the token rate
it can follow on one core. Run with `make bench` (or pytest -m slow -s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.runner import BenchResult, run_benchmark
from support.fake_server import fake_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def fast_server() -> Iterator[str]:
    """Streams as fast as it can."""
    with fake_server() as url:
        yield url


@pytest.fixture
def paced_server() -> Iterator[str]:
    """One token every 10 ms on each stream."""
    with fake_server("--itl-ms", "10") as url:
        yield url


def trace_of(path: Path, requests: int, output_tokens: int) -> Path:
    rows = [f"2023-11-16 18:00:00.0,16,{output_tokens}" for _ in range(requests)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


def timed(config: BenchConfig) -> tuple[BenchResult, float, float]:
    """The result, the generator's CPU seconds and the wall-clock seconds of a run."""
    wall = time.perf_counter()
    result = run_benchmark(config)
    return result, result.generator_cpu_s, time.perf_counter() - wall


@pytest.mark.parametrize("streams", [1, 16, 64])
def test_recording_rate(fast_server: str, tmp_path: Path, streams: int) -> None:
    tokens_each = 64_000 // streams
    trace = trace_of(tmp_path / "t.csv", streams, tokens_each)
    result, cpu_s, wall_s = timed(BenchConfig(fast_server, trace=trace, model="m"))
    overall = result.metrics.overall
    assert overall.failed == 0
    tokens = overall.output_tokens
    assert tokens == streams * tokens_each
    print(
        f"\n{streams} streams: {tokens} tokens in {wall_s:.2f} s wall = {tokens / wall_s:,.0f} "
        f"tokens/s recorded; generator CPU {1e6 * cpu_s / tokens:.1f} us/token "
        f"(at most {tokens / cpu_s:,.0f} tokens/s on one core)"
    )
    # Far above what the project's workers stream on this machine.
    assert tokens / cpu_s > 5_000


@pytest.mark.parametrize("streams", [1, 32])
def test_timing_accuracy(paced_server: str, tmp_path: Path, streams: int) -> None:
    """ITL as recorded from a server that sends a token every 10 ms on each stream.

    The spread around 10 ms is the timing noise of this machine (both processes'
    timer wake-ups and scheduling), the floor under any ITL figure measured here.
    """
    trace = trace_of(tmp_path / "t.csv", streams, 300)
    result, cpu_s, _ = timed(BenchConfig(paced_server, trace=trace, model="m"))
    overall = result.metrics.overall
    itl, tpot = overall.itl, overall.tpot
    assert itl is not None and tpot is not None
    print(
        f"\n{streams} streams x 300 tokens at 10 ms: {overall.output_throughput:,.0f} tokens/s; "
        f"ITL mean {1e3 * itl.mean:.2f} P50 {1e3 * itl.p50:.2f} P95 {1e3 * itl.p95:.2f} "
        f"P99 {1e3 * itl.p99:.2f} max {1e3 * itl.max:.2f} ms; TPOT mean {1e3 * tpot.mean:.3f} ms; "
        f"generator CPU {cpu_s:.2f} s in {result.metrics.duration_s:.2f} s "
        f"({1e6 * cpu_s / overall.output_tokens:.0f} us/token, tokens in separate reads)"
    )
    assert tpot.mean == pytest.approx(0.01, abs=0.001)
