"""Every documented request field, alone and with each other one, through a real
worker's HTTP API, streamed and not: each gets a 200 and an answer that honours every
field it carries. And the requests that used to take a worker down or get a 500."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.workers.engine.tokenizer import Tokenizer
from support.worker import ServerProcess, metric, running_worker

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running"
MAX_TOKENS = 12  # of the base request
MESSAGES = [{"role": "user", "content": PROMPT}]

Body = dict[str, Any]


@dataclass
class Answer:
    """What a client saw: token ids, text, finish reason, usage (streamed or not)."""

    tokens: list[int]
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ("--served-model-name", "small", "--max-model-len", "512")
    with running_worker(small_model_dir, tmp_path_factory.mktemp("logs"), *args) as process:
        yield process


async def post(session: aiohttp.ClientSession, url: str, body: Body) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        if response.status != 200 or not body.get("stream"):
            return response.status, await response.json()
        return 200, [json.loads(line[6:]) async for line in _events(response)]


async def _events(response: aiohttp.ClientResponse) -> Any:
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield line


def read_answer(chat: bool, body: Body, payload: Any) -> Answer:
    """The answer from a JSON body or from the list of streamed chunks."""
    key = "message" if chat else None
    if not body.get("stream"):
        choice = payload["choices"][0]
        text = choice[key]["content"] if key else choice["text"]
        return Answer(choice["token_ids"], text, choice["finish_reason"], payload["usage"])
    tokens: list[int] = []
    text, reason, usage = "", None, None
    for chunk in payload:
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            tokens += choice.get("token_ids", [])
            text += choice["delta"]["content"] if chat else choice["text"]
            reason = choice["finish_reason"] or reason
    return Answer(tokens, text, reason, usage)


@dataclass(frozen=True)
class Field:
    """A request field: the value sent, and what the answer must then show."""

    value: Body
    check: Callable[[Answer, Body, Answer], None]  # (answer, body, greedy baseline)


def _nothing(answer: Answer, body: Body, baseline: Answer) -> None:
    pass


def _max_tokens(answer: Answer, body: Body, baseline: Answer) -> None:
    assert len(answer.tokens) <= 5


def _max_completion_tokens(answer: Answer, body: Body, baseline: Answer) -> None:
    assert len(answer.tokens) <= _limit(body) <= 5


def _min_tokens(answer: Answer, body: Body, baseline: Answer) -> None:
    assert len(answer.tokens) >= 3


def _ignore_eos(answer: Answer, body: Body, baseline: Answer) -> None:
    if not {"stop", "stop_token_ids"} & set(body):
        assert len(answer.tokens) == _limit(body)


def _stop(answer: Answer, body: Body, baseline: Answer) -> None:
    stop = body["stop"][0]
    if "min_tokens" not in body:  # stop strings count only once min_tokens are out
        assert stop not in answer.text
    if stop in baseline.text and _greedy(body) and len(baseline.tokens) <= _limit(body):
        assert answer.finish_reason == "stop"


def _stop_token_ids(answer: Answer, body: Body, baseline: Answer) -> None:
    stop_id = body["stop_token_ids"][0]
    min_tokens = body.get("min_tokens", 0)
    early = [i for i, token in enumerate(answer.tokens[:-1]) if token == stop_id]
    assert all(i + 1 < min_tokens for i in early)  # only while min_tokens hold it back


def _seed(answer: Answer, body: Body, baseline: Answer) -> None:
    pass  # checked by sending the request twice (see `_assert_reproducible`)


def _stream_options(answer: Answer, body: Body, baseline: Answer) -> None:
    if body.get("stream"):
        assert answer.usage is not None
    if answer.usage is not None:
        assert answer.usage["completion_tokens"] == len(answer.tokens)


def _greedy(body: Body) -> bool:
    return body.get("temperature", 1.0) == 0 or body.get("top_k") == 1


def _limit(body: Body) -> int:
    limit: int = body.get("max_tokens", body.get("max_completion_tokens", MAX_TOKENS))
    return limit


FIELDS: dict[str, Field] = {
    "model": Field({"model": "small"}, _nothing),
    "max_tokens": Field({"max_tokens": 5}, _max_tokens),
    "temperature": Field({"temperature": 0.8, "seed": 11}, _nothing),
    "top_p": Field({"top_p": 0.5, "temperature": 1.0, "seed": 12}, _nothing),
    "top_k": Field({"top_k": 3, "temperature": 1.0, "seed": 13}, _nothing),
    "seed": Field({"seed": 7, "temperature": 1.0}, _seed),
    "stop": Field({"stop": ["<set from the baseline>"]}, _stop),
    "stop_token_ids": Field({"stop_token_ids": [-1]}, _stop_token_ids),
    "stream": Field({"stream": True}, _nothing),
    "stream_options": Field({"stream_options": {"include_usage": True}}, _stream_options),
    "ignore_eos": Field({"ignore_eos": True}, _ignore_eos),
    "min_tokens": Field({"min_tokens": 3}, _min_tokens),
    "n": Field({"n": 1}, _nothing),
    "presence_penalty": Field({"presence_penalty": 0.0}, _nothing),
    "frequency_penalty": Field({"frequency_penalty": 0.0}, _nothing),
    "logprobs": Field({"logprobs": None}, _nothing),
    "user": Field({"user": "someone"}, _nothing),
}
COMPLETION_ONLY = {"echo": Field({"echo": False}, _nothing)}
CHAT_ONLY = {"max_completion_tokens": Field({"max_completion_tokens": 3}, _max_completion_tokens)}


def bodies(fields: dict[str, Field]) -> list[tuple[tuple[str, ...], Body]]:
    """Each field alone, and each pair of fields."""
    names = list(fields)
    combos = [(name,) for name in names] + list(itertools.combinations(names, 2))
    out = []
    for combo in combos:
        body: Body = {}
        for name in combo:
            body.update(fields[name].value)
        out.append((combo, body))
    return out


async def run_matrix(worker: ServerProcess, chat: bool, tokenizer: Tokenizer) -> int:
    """Send every combination, streamed and not; check each answer; the count sent."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    url = f"{worker.url}{path}"
    base: Body = {"temperature": 0, "return_token_ids": True}
    if chat:  # max_completion_tokens is the newer name; max_tokens wins when both are set
        base |= {"messages": MESSAGES, "max_completion_tokens": MAX_TOKENS}
    else:
        base |= {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
    fields = FIELDS | (CHAT_ONLY if chat else COMPLETION_ONLY)
    async with aiohttp.ClientSession() as session:
        status, payload = await post(session, url, {**base, "ignore_eos": True})
        assert status == 200, payload
        baseline = read_answer(chat, base, payload)
        stop_text = tokenizer.decode(baseline.tokens[4:6]).strip() or "zz"
        fields["stop"] = Field({"stop": [stop_text]}, _stop)
        fields["stop_token_ids"] = Field({"stop_token_ids": [baseline.tokens[3]]}, _stop_token_ids)
        cases = [
            (combo, {**base, **extra, **stream})
            for combo, extra in bodies(fields)
            for stream in ({}, {"stream": True})
        ]
        limit = asyncio.Semaphore(8)

        async def one(combo: tuple[str, ...], body: Body) -> None:
            async with limit:
                status, payload = await post(session, url, body)
                assert status == 200, (combo, payload)
                answer = read_answer(chat, body, payload)
                for name in combo:
                    fields[name].check(answer, body, baseline)
                _assert_greedy_prefix(combo, body, answer, baseline)
                if "seed" in body and body.get("temperature"):
                    again = read_answer(chat, body, (await post(session, url, body))[1])
                    assert again.tokens == answer.tokens, combo

        await asyncio.gather(*(one(combo, body) for combo, body in cases))
    return len(cases)


def _assert_greedy_prefix(
    combo: tuple[str, ...], body: Body, answer: Answer, baseline: Answer
) -> None:
    """A greedy answer is the baseline's greedy continuation, cut where it stopped
    (unless min_tokens held a stop token back, which changes the continuation)."""
    if not _greedy(body) or {"min_tokens", "stop_token_ids"} <= set(body):
        return
    assert answer.tokens == baseline.tokens[: len(answer.tokens)], combo


def test_every_completion_field_alone_and_in_pairs(
    worker: ServerProcess, small_model_dir: Path
) -> None:
    sent = asyncio.run(run_matrix(worker, False, Tokenizer.from_dir(small_model_dir)))
    assert sent == 2 * (18 + 18 * 17 // 2)


def test_every_chat_field_alone_and_in_pairs(worker: ServerProcess, small_model_dir: Path) -> None:
    sent = asyncio.run(run_matrix(worker, True, Tokenizer.from_dir(small_model_dir)))
    assert sent == 2 * (18 + 18 * 17 // 2)


# -- requests that used to cost a worker or a 500 ---------------------------------------


def test_min_tokens_does_not_stop_the_engine(worker: ServerProcess) -> None:
    # Once answered 200 and then 503 forever: the sampler wrote into an inference tensor.
    async def both() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as session:
            return [
                await post(session, f"{worker.url}{path}", body)
                for path, body in (
                    ("/v1/completions", {"prompt": "hello", "max_tokens": 8, "min_tokens": 2}),
                    ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 2}),
                )
            ]

    for status, payload in asyncio.run(both()):
        assert status == 200, payload
    assert asyncio.run(_get_status(f"{worker.url}/health")) == 200


async def _get_status(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


@pytest.mark.parametrize(
    ("path", "data", "headers", "reason"),
    [
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
            {},
            "messages.0.content",
        ),
        (
            "/v1/completions",
            b'{"prompt": "hi"}',
            {"Content-Type": "application/json; charset=foo"},
            "charset",
        ),
        ("/v1/completions", b"[" * 100_000, {}, "nested too deeply"),
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', {}, "not valid Unicode"),
        ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [99999999]}', {}, "stop_token"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["' + b"x" * 300 + b'"]}', {}, "stop"),
    ],
)
def test_bad_requests_get_400_with_the_reason(
    worker: ServerProcess, path: str, data: bytes, headers: dict[str, str], reason: str
) -> None:
    async def send() -> tuple[int, Any]:
        sent = {"Content-Type": "application/json", **headers}
        url = f"{worker.url}{path}"
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=data, headers=sent) as answer,
        ):
            return answer.status, await answer.json()

    status, body = asyncio.run(send())
    assert status == 400, body
    assert reason in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert asyncio.run(_get_status(f"{worker.url}/health")) == 200


def test_a_body_over_the_limit_gets_413(small_model_dir: Path, tmp_path: Path) -> None:
    with running_worker(small_model_dir, tmp_path, "--max-body-size", "1KiB") as small:

        async def send() -> tuple[int, Any]:
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "x" * 4096}
                async with session.post(f"{small.url}/v1/completions", json=body) as answer:
                    return answer.status, await answer.json()

        status, body = asyncio.run(send())
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        assert metric(small, "pdserve_requests_rejected_total", reason="too_large") == 1


def test_clients_that_reuse_a_request_id_do_not_collide(worker: ServerProcess) -> None:
    # Ingresses and client retries reuse ids: both requests are served, and each
    # answer echoes the client's id.
    async def twice() -> list[tuple[int, str, list[Any]]]:
        headers = {"X-Request-Id": "same-id"}
        body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:

            async def one() -> tuple[int, str, list[Any]]:
                url = f"{worker.url}/v1/completions"
                async with session.post(url, json=body, headers=headers) as answer:
                    chunks = [json.loads(line[6:]) async for line in _events(answer)]
                    return answer.status, answer.headers["X-Request-Id"], chunks

            return list(await asyncio.gather(one(), one()))

    for status, echoed, chunks in asyncio.run(twice()):
        assert status == 200 and echoed == "same-id"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    ids = {chunks[0]["id"] for _, _, chunks in asyncio.run(twice())}
    assert len(ids) == 2  # the worker's own ids


def test_openapi_describes_both_endpoints(worker: ServerProcess) -> None:
    async def fetch() -> Any:
        url = f"{worker.url}/openapi.json"
        async with aiohttp.ClientSession() as session, session.get(url) as answer:
            return await answer.json()

    spec = asyncio.run(fetch())
    for path in ("/v1/completions", "/v1/chat/completions"):
        schema_ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = schema_ref["schema"]["$ref"].rsplit("/", 1)[1]
        properties = spec["components"]["schemas"][name]["properties"]
        assert {"max_tokens", "stop", "min_tokens", "stream"} <= set(properties)
