"""A decode worker whose answers a test scripts, for a real router to face: the
`user` field of each request's body (which the router passes on unchanged) names
what it does. It answers at once, or holds the request at a chosen stage (before its
answer's headers, after the headers but before the first token, mid-stream, after the
end of the stream) until its client goes away, telling the test when it got there.
Runs on the test's event loop; a request whose client (the router) goes away is
cancelled, as in a real worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from pdserve.protocol.api_errors import error_body
from pdserve.protocol.headers import MODE_HEADER, PREFILL_URL_HEADER

# What a request's `user` field may ask for.
OK = "ok"
INVALID = "invalid"  # a 400, the client's fault
FAILING = "failing"  # a 500
HOLD_HEADERS = "hold-headers"  # no answer yet
HOLD_FIRST_TOKEN = "hold-first-token"  # a stream's headers and an event without tokens
HOLD_MID_STREAM = "hold-mid-stream"  # a stream's first TOKENS_BEFORE_HOLD tokens
HOLD_AFTER_DONE = "hold-after-done"  # a whole stream, [DONE] included, never closed
TOKENS = 3
TOKENS_BEFORE_HOLD = 2


class FakeWorker:
    """The scripted worker: `serving()` it, await `held()` for each holding request."""

    def __init__(self) -> None:
        self._held: asyncio.Queue[str] = asyncio.Queue()
        self.modes: list[str] = []  # how each request was asked for: colocated, disaggregated
        self.peers: list[Any] = []  # the address each request came from (its connection)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """Its URL on loopback (a port the system picks), for as long as the block runs."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/load", self.load)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        try:
            yield f"http://{host}:{port}"
        finally:
            await runner.cleanup()

    async def held(self, timeout_s: float = 60.0) -> str:
        """The script of the next request to reach its holding point."""
        return await asyncio.wait_for(self._held.get(), timeout_s)

    async def load(self, _: web.Request) -> web.Response:
        return web.json_response({"role": "decode", "in_flight": 0, "running": 0, "waiting": 0,
                                  "kv_cache_usage": 0.0, "prefill_tokens": 0})  # fmt: skip

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        script = body.get("user", OK)
        transport = request.transport
        self.peers.append(None if transport is None else transport.get_extra_info("peername"))
        mode = "disaggregated" if PREFILL_URL_HEADER in request.headers else "colocated"
        self.modes.append(mode)
        if script == INVALID:
            return web.json_response(
                error_body("scripted", "invalid_request_error", None), status=400
            )
        if script == FAILING:
            return web.json_response(error_body("scripted", "server_error", None), status=500)
        if script == HOLD_HEADERS:
            await self._hold(script)
        if not body.get("stream"):
            return web.json_response(_completion([_choice(TOKENS, "length")]),
                                     headers={MODE_HEADER: mode})  # fmt: skip
        return await self._stream(request, script, mode)

    async def _stream(self, request: web.Request, script: str, mode: str) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", MODE_HEADER: mode}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        if script == HOLD_FIRST_TOKEN:
            await _event(response, _completion([_choice(0, None)]))
            await self._hold(script)
        for token in range(TOKENS):
            if script == HOLD_MID_STREAM and token == TOKENS_BEFORE_HOLD:
                await self._hold(script)
            reason = "length" if token == TOKENS - 1 else None
            await _event(response, _completion([_choice(1, reason)]))
        await response.write(b"data: [DONE]\n\n")
        if script == HOLD_AFTER_DONE:
            await self._hold(script)
        await response.write_eof()
        return response

    async def _hold(self, script: str) -> None:
        """Until the request is cancelled."""
        self._held.put_nowait(script)
        await asyncio.Event().wait()


def _choice(tokens: int, reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": "x" * tokens, "logprobs": None, "finish_reason": reason,
            "token_ids": list(range(5, 5 + tokens))}  # fmt: skip


def _completion(choices: list[dict[str, Any]]) -> dict[str, Any]:
    usage = {"prompt_tokens": 1, "completion_tokens": TOKENS, "total_tokens": 1 + TOKENS}
    return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "small",
            "choices": choices, "usage": usage}  # fmt: skip


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
