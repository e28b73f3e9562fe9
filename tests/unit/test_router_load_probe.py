"""The router's load probe as a liveness check: a worker that answers its probe late
while it answers requests is slow, not down, and keeps its traffic; one that answers
nothing, or cannot be reached, is taken out of rotation."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from pdserve.workers.router.load import LoadPoller
from pdserve.workers.router.workers import Worker

PROBE_TIMEOUT_S = 0.2


@pytest.fixture
async def silent_worker() -> AsyncIterator[str]:
    """A worker whose /load never answers (its serving loop starved, say)."""
    stalled = asyncio.Event()

    async def load(_: web.Request) -> web.Response:
        await stalled.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/load", load)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stalled.set()
        await runner.cleanup()


async def _probe(poller: LoadPoller, worker: Worker, *, answered_meanwhile: bool) -> None:
    probe = asyncio.ensure_future(poller.poll(worker))
    await asyncio.sleep(0)  # the probe is sent and waiting
    if answered_meanwhile:
        worker.breaker.succeeded()  # a request to it was answered
    await probe


@pytest.mark.parametrize("answered_meanwhile", [True, False])
async def test_late_probes_open_the_breaker_only_when_the_worker_answered_nothing(
    silent_worker: str, answered_meanwhile: bool
) -> None:
    worker = Worker(silent_worker, "decode")
    async with aiohttp.ClientSession() as session:
        poller = LoadPoller(session, [], timeout_s=PROBE_TIMEOUT_S)
        for _ in range(worker.breaker.threshold):
            await _probe(poller, worker, answered_meanwhile=answered_meanwhile)
    if answered_meanwhile:
        assert worker.breaker.state == "closed" and worker.breaker.available()
    else:
        assert worker.breaker.state == "open" and not worker.breaker.available()


async def test_an_unreachable_worker_is_taken_out() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    worker = Worker(f"http://127.0.0.1:{sock.getsockname()[1]}", "decode")
    try:
        async with aiohttp.ClientSession() as session:
            poller = LoadPoller(session, [], timeout_s=PROBE_TIMEOUT_S)
            for _ in range(worker.breaker.threshold):
                await _probe(poller, worker, answered_meanwhile=False)
    finally:
        sock.close()
    assert worker.breaker.state == "open"
