"""A worker's KV events streamed over one long-lived answer, and the router following
it: one line per publish, in order; a gap or another epoch sends the router to a
snapshot; a reader that falls behind is cut with a gap instead of being buffered for;
a worker that restarts is read again. Real servers and clients on the loopback, the
worker's side fed by a real `KVEventLog`."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from pdserve.protocol.api_errors import error_middleware
from pdserve.protocol.internal import InternalAuth, bearer
from pdserve.workers.engine.kv_events import KVEventLog
from pdserve.workers.kv_wire import EVENTS_PATH, STREAM_PATH, KVIdentity
from pdserve.workers.router.kv_index import block_key
from pdserve.workers.router.kv_metrics import KVRoutingMetrics
from pdserve.workers.router.kv_subscriber import Expected, KVFeeds, KVFeedStatus
from pdserve.workers.server.kv_feed import KVFeed, kv_identity

CREDENTIAL = "a-pool-credential-long-enough-for-the-check"
BLOCK = 16
MODEL = "m"
T = TypeVar("T")


def identity() -> KVIdentity:
    return kv_identity(BLOCK, "", MODEL, "w", num_blocks=100_000)


def block(n: int) -> bytes:
    return n.to_bytes(16, "little")  # the index keys a block by its first 8 bytes


def step(log: KVEventLog, *numbers: int, removed: bool = False) -> None:
    """One engine step: blocks stored (or removed), then published."""
    for n in numbers:
        (log.removed if removed else log.stored)(block(n))
    log.publish()


async def settle() -> None:
    """Let every task woken so far run to its next wait (the feed's wake-up, then its
    handler: a few turns of the loop)."""
    for _ in range(8):
        await asyncio.sleep(0)


async def until(check: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (found := check()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return found


class Worker:
    """A worker's feed on a port of its own, restartable there with a new log."""

    def __init__(self, log: KVEventLog, sock: socket.socket | None = None) -> None:
        self.log = log
        self.feed = KVFeed(log, identity())
        self.sock = sock or _listening()
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.url = "http://{}:{}".format(*self.address)
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        middlewares = [error_middleware(lambda *_: None), InternalAuth(CREDENTIAL).middleware()]
        app = web.Application(middlewares=middlewares)
        self.feed.add_routes(app)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def restart(self) -> None:
        """Stop, and start again on the same port with a new log (a new epoch, empty)."""
        await self.stop()
        self.sock = _listening(*self.address)
        self.log = KVEventLog()
        self.feed = KVFeed(self.log, identity())
        await self.start()


def _listening(
    host: str = "127.0.0.1", port: int = 0, send_buffer: int | None = None
) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:  # inherited by the connections it accepts
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind((host, port))
    sock.listen()
    sock.setblocking(False)
    return sock


@asynccontextmanager
async def running(log: KVEventLog, sock: socket.socket | None = None) -> AsyncIterator[Worker]:
    worker = Worker(log, sock)
    await worker.start()
    try:
        yield worker
    finally:
        if worker.runner is not None:
            await worker.runner.cleanup()


@asynccontextmanager
async def router() -> AsyncIterator[tuple[KVFeeds, CollectorRegistry]]:
    registry = CollectorRegistry()
    metrics = KVRoutingMetrics("p", registry)
    async with aiohttp.ClientSession() as session:
        feeds = KVFeeds(session, bearer(CREDENTIAL), Expected(BLOCK, MODEL), metrics)
        try:
            yield feeds, registry
        finally:
            await feeds.stop()


def resyncs(registry: CollectorRegistry, reason: str) -> float:
    found = registry.get_sample_value(
        "pdserve_router_kv_resyncs_total",
        {"pool": "p", "role": "router", "target": "decode", "reason": reason},
    )
    return found or 0.0


def holds(feeds: KVFeeds, url: str, *numbers: int) -> bool:
    index = feeds.indexes["decode"]
    return all(index.cached_blocks([block_key(block(n))]).get(url) == 1 for n in numbers)


async def stream_lines(
    url: str, query: str, headers: dict[str, str] | None = None
) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:
    session = aiohttp.ClientSession()
    response = await session.get(
        url + STREAM_PATH + query, headers=bearer(CREDENTIAL) if headers is None else headers
    )
    return session, response


async def next_line(response: aiohttp.ClientResponse) -> dict[str, Any]:
    line = await asyncio.wait_for(response.content.readline(), 30)
    assert line.endswith(b"\n"), line
    body: dict[str, Any] = json.loads(line)
    return body


async def test_each_publish_is_one_line_of_that_steps_events_in_order() -> None:
    log = KVEventLog()
    step(log, 1)
    async with running(log) as worker:
        session, response = await stream_lines(worker.url, f"?epoch={log.epoch}&after=0")
        async with session, response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/x-ndjson"
            first = await next_line(response)  # at once: what the subscriber lacks
            assert first["epoch"] == log.epoch and not first["gap"]
            assert [(e["seq"], e["kind"]) for e in first["events"]] == [(1, "stored")]
            lines = []
            for numbers, removed in (((2, 3), False), ((2,), True), ((4,), False)):
                step(log, *numbers, removed=removed)
                lines.append(await next_line(response))
    events = [[(e["seq"], e["kind"], e["hashes"]) for e in line["events"]] for line in lines]
    assert events == [
        [(3, "stored", [block(2).hex(), block(3).hex()])],
        [(4, "removed", [block(2).hex()])],
        [(5, "stored", [block(4).hex()])],
    ]
    assert [line["seq"] for line in lines] == [3, 4, 5]


async def test_the_stream_needs_the_pools_credential() -> None:
    log = KVEventLog()
    async with running(log) as worker:
        session, response = await stream_lines(worker.url, "?after=0", headers={})
        async with session, response:
            assert response.status == 401


async def test_another_epoch_is_told_as_a_gap_that_ends_the_stream() -> None:
    log = KVEventLog()
    step(log, 1)
    async with running(log) as worker:
        session, response = await stream_lines(worker.url, "?epoch=an-old-one&after=1")
        async with session, response:
            line = await next_line(response)
            assert line["gap"] and line["epoch"] == log.epoch and line["events"] == []
            assert await asyncio.wait_for(response.content.read(), 30) == b""  # ended


async def test_the_router_follows_the_stream_into_its_index() -> None:
    log = KVEventLog()
    step(log, 1, 2)
    async with running(log) as worker, router() as (feeds, registry):
        feeds.track("decode", [worker.url])
        await until(lambda: holds(feeds, worker.url, 1, 2), "the snapshot in the index")
        step(log, 3)
        step(log, 1, removed=True)
        await until(lambda: holds(feeds, worker.url, 2, 3), "the streamed blocks")
        await until(lambda: not holds(feeds, worker.url, 1), "the removed block gone")
        status = feeds.status("decode", worker.url)
        assert status is not None and status.state == "synced" and status.seq == log.seq
        # Followed from one snapshot and one stream: no resync, no reconnect.
        assert resyncs(registry, "start") == 1
        assert resyncs(registry, "gap") == resyncs(registry, "reconnect") == 0
        assert worker.feed.streams == 1


async def test_a_subscriber_behind_more_than_the_worker_keeps_resyncs_from_a_snapshot() -> None:
    log = KVEventLog(capacity=4)
    async with running(log) as worker, router() as (feeds, registry):
        feeds.track("decode", [worker.url])
        await until(lambda: (s := feeds.status("decode", worker.url)) and s.state == "synced",
                    "the first snapshot")  # fmt: skip
        await until(lambda: worker.feed.streams == 1, "the stream open")
        # Ten steps before the stream's handler runs again: it finds the first of them
        # no longer kept, says so and ends; the router reads a snapshot.
        for n in range(10):
            step(log, n, removed=n % 2 == 1)  # alternate kinds: one event each
        await until(lambda: resyncs(registry, "gap") == 1, "a resync for the gap")
        await until(lambda: holds(feeds, worker.url, 0, 2, 4, 6, 8), "the snapshot's blocks")
        assert not holds(feeds, worker.url, 1)
        # ... and follows the new stream on.
        step(log, 20)
        await until(lambda: holds(feeds, worker.url, 20), "a block after the resync")
        assert resyncs(registry, "reconnect") == 0


async def test_a_reader_that_stops_reading_is_cut_with_a_gap_not_buffered_for() -> None:
    log = KVEventLog(capacity=16)
    sock = _listening(send_buffer=4096)
    async with running(log, sock) as worker:
        reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(reader, sock.getsockname())
        head = (
            f"GET {STREAM_PATH}?epoch={log.epoch}&after=0 HTTP/1.1\r\nHost: w\r\n"
            f"Authorization: Bearer {CREDENTIAL}\r\n\r\n"
        )
        await loop.sock_sendall(reader, head.encode())
        await until(lambda: worker.feed.streams == 1, "the stream open")
        # Each step stores 64 blocks (one event of 64 hashes, ~2.2 kB a line), ten
        # times over what the connection's buffers take while nothing is read.
        published = 400
        connection = worker.runner.server.connections[0]  # type: ignore[union-attr]
        most_unsent = 0
        for n in range(published):
            step(log, *range(64 * n, 64 * n + 64))
            await settle()
            transport = connection.transport
            if transport is not None:
                most_unsent = max(most_unsent, transport.get_write_buffer_size())
        # What the worker holds for the stalled reader stays bounded by the connection's
        # buffer (the stream keeps no events of its own) ...
        assert most_unsent < 256 * 1024
        received = await _read_all(loop, reader)
    lines = [json.loads(line) for line in _chunked_body(received).splitlines() if line]
    # ... and when the reader takes what was sent, it finds the events in order up to
    # where it fell behind, then a gap, and the end of the stream.
    assert lines[-1]["gap"] and lines[-1]["events"] == []
    numbers = [event["seq"] for line in lines[:-1] for event in line["events"]]
    assert numbers == list(range(64, 64 * (len(numbers) + 1), 64))
    assert 0 < len(numbers) < published


async def _read_all(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    received = bytearray()
    while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 30):
        received += chunk
        if received.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            break
    sock.close()
    return bytes(received)


def _chunked_body(answer: bytes) -> bytes:
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2 :]


async def test_a_restarted_worker_is_read_again_in_its_new_epoch() -> None:
    log = KVEventLog()
    step(log, 1)
    async with running(log) as worker, router() as (feeds, registry):
        feeds.track("decode", [worker.url])
        await until(lambda: holds(feeds, worker.url, 1), "the first worker's block")
        await until(lambda: worker.feed.streams == 1, "the stream open")
        first_epoch = log.epoch
        # A stopping worker ends its streams at once: it waits for no subscriber.
        await asyncio.wait_for(worker.restart(), 30)
        step(worker.log, 7)

        def new_epoch() -> bool:
            status = feeds.status("decode", worker.url)
            return status is not None and status.state == "synced" and status.epoch not in (
                None, first_epoch
            )  # fmt: skip

        await until(new_epoch, "the restarted worker followed")
        await until(lambda: holds(feeds, worker.url, 7), "the restarted worker's block")
        assert not holds(feeds, worker.url, 1)  # the old cache went with the old process
        assert resyncs(registry, "reconnect") >= 1
        step(worker.log, 8)
        await until(lambda: holds(feeds, worker.url, 8), "a block streamed after restarting")


def bad_line_worker(line: bytes) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(line + b"\n")
        await asyncio.sleep(30)
        return response

    return stream


@pytest.mark.parametrize(
    "line",
    [b'{"epoch": "E", "seq": 2, "events": [{"seq": 2, "kind": "stored", "hashes": ["zz"]}]}',
     b"not json"],
)  # fmt: skip
async def test_a_stream_line_that_is_not_the_wire_format_refuses_the_worker(line: bytes) -> None:
    log = KVEventLog(epoch="E")
    worker = Worker(log)
    app = web.Application()
    app.router.add_get("/pd/kv/snapshot", worker.feed.snapshot)
    app.router.add_get(STREAM_PATH, bad_line_worker(line))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, worker.sock).start()
    try:
        async with router() as (feeds, _):
            feeds.track("decode", [worker.url])

            def refused() -> KVFeedStatus | None:
                status = feeds.status("decode", worker.url)
                return status if status is not None and status.state == "refused" else None

            status = await until(refused, "the worker refused")
            assert "sent an unusable line" in (status.reason or "")
    finally:
        await runner.cleanup()


async def test_a_worker_without_the_stream_is_followed_by_polling_its_events() -> None:
    """A worker of an earlier version (during a rolling update) serves the snapshot
    and the events one request at a time: the router polls it, and its blocks still
    reach the index."""
    log = KVEventLog()
    step(log, 1)
    worker = Worker(log)
    app = web.Application(middlewares=[error_middleware(lambda *_: None)])
    app.router.add_get("/pd/kv/snapshot", worker.feed.snapshot)
    app.router.add_get(EVENTS_PATH, worker.feed.events)
    app.on_startup.append(worker.feed._bind_loop)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, worker.sock).start()
    try:
        async with router() as (feeds, registry):
            feeds.track("decode", [worker.url])
            await until(lambda: holds(feeds, worker.url, 1), "the snapshot in the index")
            await until(lambda: worker.feed.streams == 1, "an events request waiting")
            step(log, 2)
            await until(lambda: holds(feeds, worker.url, 2), "a polled block")
            status = feeds.status("decode", worker.url)
            assert status is not None and status.state == "synced"
            assert resyncs(registry, "start") == 1 and resyncs(registry, "reconnect") == 0
    finally:
        await runner.cleanup()
