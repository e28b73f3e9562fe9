"""A worker's network limits against clients that cost what they can, on raw sockets:
half-sent headers, bodies that stop, idle connections and streams nobody reads are
cut off within their timeouts (set small by flags here), each refusal counted; a
stream whose client does not read holds a bounded number of tokens, then its request
is aborted and its KV cache freed while other requests stream on.

A time limit judged here is a lower bound (the server waits its whole timeout) and a
generous upper one, a multiple of the timeout (it cuts the client off rather than
waiting for minutes, as it did without the limits), so a loaded machine passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pdserve.workers.server.process import ServerProcess
from support.router import stream
from support.slow_clients import (
    HEAVY_STREAM,
    LATE,
    REFUSALS,
    assert_cut_off,
    assert_half_headers_cut_off,
    assert_stopped_body_gets_408,
    close_all,
    health_check,
    rss_bytes,
    send_half_headers,
    start_unread_stream,
    wait_closed,
    wait_unread_stream_ended,
)
from support.worker import metric, running_worker, wait_engine_emptied

HEADER_S = 1.0
BODY_S = 1.0
KEEP_ALIVE_S = 2.0
WRITE_S = 1.0
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A worker with short network timeouts; no bound on buffered tokens worth the
    name, so a client that stops reading meets the write timeout."""
    args = (
        "--timeout-request-headers", str(HEADER_S), "--timeout-request-body", str(BODY_S),
        "--timeout-keep-alive", str(KEEP_ALIVE_S), "--timeout-write", str(WRITE_S),
        "--max-stream-buffer-tokens", "1000000",
    )  # fmt: skip
    with running_worker(small_model_dir, tmp_path_factory.mktemp("worker"), *args) as started:
        yield started


def test_half_sent_headers_are_cut_off_within_the_header_timeout(worker: ServerProcess) -> None:
    assert_half_headers_cut_off(worker.url, 20, HEADER_S)
    # Headers completed now are not served: the connection is gone (before the
    # limits, they were, after minutes).
    late = send_half_headers(worker.url)
    try:
        wait_closed(late, LATE * HEADER_S)
        try:
            late.sendall(b"Content-Length: 2\r\n\r\n{}")
            assert late.recv(1024) == b""
        except (BrokenPipeError, ConnectionResetError):
            pass
    finally:
        late.close()
    assert metric(worker, REFUSALS, reason="header_timeout") == 21
    # Headers sent in pieces, none late, are served.
    with health_check(worker.url) as (answer, _):
        assert answer.status == 200


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(worker: ServerProcess) -> None:
    cut_before = metric(worker, REFUSALS)
    # The server's idle time starts after it has the request, so after this instant;
    # not after the answer was read here (a busy machine may read it late).
    before_request = time.monotonic()
    with health_check(worker.url) as (answered, sock):
        assert (answered.status, answered.headers.get("connection")) == (200, None)
        closed = wait_closed(sock, LATE * KEEP_ALIVE_S)
    assert closed.status is None  # nothing more was sent
    assert_cut_off(closed.closed_at - before_request, KEEP_ALIVE_S)
    assert metric(worker, REFUSALS) == cut_before  # an idle connection is not a refusal


def test_a_body_that_stops_gets_408_within_the_body_timeout(worker: ServerProcess) -> None:
    assert_stopped_body_gets_408(worker.url, BODY_S)
    assert metric(worker, REFUSALS, reason="body_timeout") == 1
    assert metric(worker, "pdserve_requests_rejected_total", reason="body_timeout") == 1


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(
    worker: ServerProcess,
) -> None:
    sock = start_unread_stream(worker.url, "/v1/chat/completions", HEAVY_STREAM)
    try:
        wait_unread_stream_ended(worker.url, worker)
    finally:
        sock.close()


@pytest.fixture(scope="module")
def bounded(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A worker with the default bound on buffered tokens, and a write timeout too long
    to matter."""
    folder = tmp_path_factory.mktemp("bounded")
    with running_worker(small_model_dir, folder, "--timeout-write", "600") as started:
        yield started


def test_a_stream_nobody_reads_is_bounded_and_others_stream_on(bounded: ServerProcess) -> None:
    pid = bounded.process.pid
    prompt = list(range(10, 40))

    async def scenario() -> tuple[int, int, list[tuple[int, list[int], object]]]:
        async with aiohttp.ClientSession() as session:
            # Once, so what a heavy request needs (its batch, its log-probabilities)
            # is in the baseline.
            assert (await stream(session, bounded.url, prompt, 4))[0] == 200
            baseline = peak = rss_bytes(pid)
            unread = [
                await asyncio.to_thread(
                    start_unread_stream, bounded.url, "/v1/chat/completions", HEAVY_STREAM
                )
                for _ in range(2)
            ]
            try:
                during = asyncio.ensure_future(stream(session, bounded.url, prompt, 200))
                # How long the engine takes to fill the connections' buffers and then
                # the bound depends on the machine; the memory it may take does not.
                deadline = time.monotonic() + 600
                while await asyncio.to_thread(aborted, bounded) < 2:
                    peak = max(peak, rss_bytes(pid))
                    assert time.monotonic() < deadline, f"grew {grown(peak - baseline)}"
                    await asyncio.sleep(0.5)
                meanwhile = await during
                await asyncio.to_thread(wait_engine_emptied, bounded)
                # The unread connections are still open; nothing grows while others
                # go on streaming.
                after = await stream(session, bounded.url, prompt, 200)
                peak = max(peak, rss_bytes(pid))
                return baseline, peak, [meanwhile, after]
            finally:
                close_all(unread)

    baseline, peak, answers = asyncio.run(scenario())
    for status, tokens, error in answers:
        assert (status, len(tokens), error) == (200, 200, None)
    assert peak - baseline < 50 * MIB, f"grew {grown(peak - baseline)}"
    assert metric(bounded, "pdserve_requests_aborted_total", reason="stream_buffer_full") == 2


def grown(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


def aborted(worker: ServerProcess) -> float:
    return metric(worker, "pdserve_requests_aborted_total", reason="stream_buffer_full")
