"""The one place that turns errors into answers (`error_middleware`), on a real aiohttp
server: a client that leaves mid-stream is an ordinary event, logged as such, while a
connection reset that is not the client's is still an error."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from pdserve.protocol.api_errors import error_middleware
from support.network import serving


async def test_a_client_leaving_mid_stream_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    ended = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while True:  # until the write fails: the client has gone
                await response.write(b"data: {}\n\n")
                await asyncio.sleep(0.01)
        finally:
            ended.set()

    app = web.Application(middlewares=[error_middleware()])
    app.router.add_get("/stream", endless)
    caplog.set_level(logging.INFO)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        async with session.get(f"{url}/stream", headers={"X-Request-Id": "c-1"}) as answer:
            await answer.content.readline()
        await asyncio.wait_for(ended.wait(), 30)
    gone = [r for r in caplog.records if "the client went away" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in gone] == [
        (logging.INFO, "GET /stream (X-Request-Id c-1): the client went away")
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_reset_that_is_not_the_clients_is_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def peer_reset(_: web.Request) -> web.Response:
        raise ConnectionResetError("a peer of the server reset its connection")

    app = web.Application(middlewares=[error_middleware()])
    app.router.add_get("/call", peer_reset)
    async with (
        serving(app) as url,
        aiohttp.ClientSession() as session,
        session.get(f"{url}/call") as answer,
    ):
        assert answer.status == 500
        assert (await answer.json())["error"]["type"] == "server_error"
    assert any(r.levelno == logging.ERROR for r in caplog.records)
