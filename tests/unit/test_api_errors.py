"""The one place that turns errors into answers (`error_middleware`), on a real aiohttp
server: a client that leaves mid-stream is an ordinary event, logged as such, while a
connection reset that is not the client's is still an error. And request bodies parsed
as Python's own parser reads them, faults named alike."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from pdserve.protocol.api_errors import APIError, error_middleware, parse_json
from pdserve.protocol.requests import CompletionRequest
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


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": [1, 2], "max_tokens": 4, "stream": true}',
        b'{"prompt": "caf\xc3\xa9 \\u00e9 \\ud83d\\ude00", "stop": ["\\n"]}',
        b'{"temperature": NaN, "top_p": Infinity, "seed": -Infinity}',  # as Python writes them
        b'{"seed": 18446744073709551615, "n": -9223372036854775808}',
        b'{"a": 1, "a": 2, "b": 1e-320, "c": -0.0, "d": [[[]]], "e": null}',
    ],
)
def test_bodies_parse_as_python_s_parser_reads_them(body: bytes) -> None:
    parsed = parse_json(body)
    expected = json.loads(body)
    assert json.dumps(parsed, sort_keys=True) == json.dumps(expected, sort_keys=True)
    assert [type(v) for v in parsed.values()] == [type(v) for v in expected.values()]


def test_integers_past_64_bits_are_refused_by_every_bound() -> None:
    # orjson reads them as floats, Python's parser as ints: no field takes either.
    for field in ("max_tokens", "n", "seed", "top_k", "min_tokens", "logprobs"):
        body = f'{{"prompt": [1], "{field}": {2**70}}}'.encode()
        with pytest.raises(ValidationError, match=field):
            CompletionRequest.model_validate(parse_json(body))
    with pytest.raises(ValidationError, match="prompt"):
        CompletionRequest.model_validate(parse_json(f'{{"prompt": [{2**70}]}}'.encode()))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"prompt": "a\\ud800b"}', "not valid Unicode"),
        (b'{"prompt": "a\xffb"}', "not valid Unicode"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"prompt": [1, 2}', "malformed JSON body"),
        (b"", "malformed JSON body"),
    ],
)
def test_bodies_that_are_not_json_in_unicode_are_refused_naming_why(
    body: bytes, message: str
) -> None:
    with pytest.raises(APIError) as refused:
        parse_json(body)
    assert refused.value.status == 400 and message in str(refused.value)
