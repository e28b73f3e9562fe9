"""The streaming client against servers that stream in odd ways."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.protocol.sse import chunk_token_count
from pdserve.workers.bench.client import CompletionsClient
from pdserve.workers.bench.records import RequestRecord
from support.network import serving

pytestmark = pytest.mark.timeout(30)


def event(body: Any) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def text(value: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": value}]}


# Keep-alive comments, an empty-text token (text held back), CRLF line ends, a chunk
# that only closes the stream, then usage and [DONE].
ODD_BUT_VALID = [
    b": keep-alive\n\n",
    event(text("a")),
    event(text("")),
    event(text("bc")).replace(b"\n", b"\r\n"),
    event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
    event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}),
    b"data: [DONE]\n\n",
]
ERROR_MID_STREAM = [event(text("a")), event({"error": {"message": "worker gone"}})]
NO_DONE = [event(text("a")), event(text("b"))]
NOT_JSON = [event(text("a")), b"data: {oops\n\n"]
# transformers serve: the stream closes after the choice's finish reason, no [DONE].
CLOSED_AFTER_FINISH = [
    event(text("a")),
    event({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}),
]
SCRIPTS = {
    "odd": ODD_BUT_VALID, "error": ERROR_MID_STREAM, "nodone": NO_DONE, "bad": NOT_JSON,
    "closed": CLOSED_AFTER_FINISH,
}  # fmt: skip


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["model"] == "busy":
            return web.Response(status=503, text="overloaded")  # not even JSON
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for line in SCRIPTS[body["model"]]:
            await response.write(line)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        yield url


async def send(base_url: str, model: str) -> RequestRecord:
    record = RequestRecord(0, "test", 5, 3, scheduled_at=0.0)
    async with aiohttp.ClientSession() as session:
        await CompletionsClient(session, base_url, model).send(record, [5, 6, 7, 8, 9])
    return record


async def test_odd_but_valid_stream(base_url: str) -> None:
    record = await send(base_url, "odd")
    assert record.ok
    # "a", the held-back token and "bc"; the comment and the closing chunk are not tokens.
    assert record.chunk_tokens == [1, 1, 1]
    assert record.usage_completion_tokens == 3
    assert record.usage_prompt_tokens == 5


async def test_a_stream_closed_after_its_finish_reason_is_whole(base_url: str) -> None:
    record = await send(base_url, "closed")
    assert record.ok
    assert record.chunk_tokens == [1, 1]


@pytest.mark.parametrize(
    ("model", "error"),
    [
        ("error", "stream error: worker gone"),
        ("nodone", "stream ended before [DONE]"),
        ("bad", "bad response: JSONDecodeError"),
        ("busy", "HTTP 503: overloaded"),
    ],
)
async def test_broken_streams_are_failures(base_url: str, model: str, error: str) -> None:
    record = await send(base_url, model)
    assert not record.ok
    assert record.error is not None and record.error.startswith(error)
    assert record.ended_at is not None


def test_explicit_token_counts_win_over_text() -> None:
    assert chunk_token_count({"choices": [{"text": "abc", "token_ids": [1, 2, 3]}]}) == 3
    assert chunk_token_count({"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}) == 2
    assert chunk_token_count({"choices": [{"text": "abc"}]}) == 1
    assert chunk_token_count({"choices": [{"text": "", "finish_reason": None}]}) == 1
    assert chunk_token_count({"choices": [{"text": "", "finish_reason": "stop"}]}) == 0
    assert chunk_token_count({"choices": [{"text": "z", "finish_reason": "stop"}]}) == 1
    assert chunk_token_count({"choices": [], "usage": {"completion_tokens": 9}}) == 0


def test_chat_chunks_count_their_content() -> None:
    last = {"delta": {"content": "z"}, "finish_reason": "length"}
    assert chunk_token_count({"choices": [last]}) == 1  # the last token, with the reason
    closing = {"delta": {"content": ""}, "finish_reason": "stop"}
    assert chunk_token_count({"choices": [closing]}) == 0
    listed = {"delta": {"content": "ab"}, "logprobs": {"content": [{}, {}]}}
    assert chunk_token_count({"choices": [listed]}) == 2
