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

from pdserve.workers.model.tokenizer import Tokenizer
from support.worker import ServerProcess, metric, running_worker

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running"
MAX_TOKENS = 12  # of the base request
MESSAGES = [{"role": "user", "content": PROMPT}]

Body = dict[str, Any]


@dataclass
class Answer:
    """What a client saw of one choice: token ids, text (after the echoed prompt, if
    any), finish reason, log-probabilities, and the answer's usage and token count
    over all choices (streamed or not)."""

    tokens: list[int]
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    logprobs: dict[str, list[Any]] | None = None
    echoed: str = ""
    all_tokens: int = 0
    prompt_tokens: int = 0


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


def read_answers(chat: bool, body: Body, payload: Any, prompt_tokens: int = 0) -> list[Answer]:
    """Each choice's answer, from a JSON body or from the list of streamed chunks."""
    if not body.get("stream"):
        assert [choice["index"] for choice in payload["choices"]] == list(range(body.get("n", 1)))
        answers = [_whole_choice(chat, choice, payload["usage"]) for choice in payload["choices"]]
    else:
        answers = _streamed_choices(chat, payload, body.get("n", 1))
    for answer in answers:
        answer.all_tokens = sum(len(other.tokens) for other in answers)
        answer.prompt_tokens = prompt_tokens
        if body.get("echo"):
            assert answer.text.startswith(PROMPT)
            answer.echoed, answer.text = PROMPT, answer.text[len(PROMPT) :]
    return answers


def _whole_choice(chat: bool, choice: dict[str, Any], usage: dict[str, Any]) -> Answer:
    text = choice["message"]["content"] if chat else choice["text"]
    return Answer(choice["token_ids"], text, choice["finish_reason"], usage, choice["logprobs"])


def _streamed_choices(chat: bool, payload: list[dict[str, Any]], n: int) -> list[Answer]:
    answers: dict[int, Answer] = {}
    usage = None
    for chunk in payload:
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            answer = answers.setdefault(choice["index"], Answer([], "", None, None))
            answer.tokens += choice.get("token_ids", [])
            answer.text += choice["delta"]["content"] if chat else choice["text"]
            answer.finish_reason = choice["finish_reason"] or answer.finish_reason
            if choice["logprobs"] is not None:
                merged = answer.logprobs = answer.logprobs or {}
                for key, values in choice["logprobs"].items():
                    merged[key] = merged.get(key, []) + values
    assert sorted(answers) == list(range(n))
    for answer in answers.values():
        answer.usage = usage
    return [answers[index] for index in range(n)]


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
        assert answer.usage["completion_tokens"] == answer.all_tokens


def _n(answer: Answer, body: Body, baseline: Answer) -> None:
    pass  # every answer is checked to have n choices (see `read_answers`)


def _echo(answer: Answer, body: Body, baseline: Answer) -> None:
    assert answer.echoed == PROMPT


def _completion_logprobs(answer: Answer, body: Body, baseline: Answer) -> None:
    logprobs = answer.logprobs
    assert logprobs is not None
    values, tops = logprobs["token_logprobs"], logprobs["top_logprobs"]
    echoed = answer.prompt_tokens if body.get("echo") else 0
    assert len(values) == len(tops) == len(logprobs["tokens"]) == echoed + len(answer.tokens)
    assert len(logprobs["text_offset"]) == len(values)
    if echoed:  # the prompt's first token has nothing before it
        assert values[0] is None and tops[0] is None
        values, tops = values[1:], tops[1:]
    for value, top in zip(values, tops, strict=True):
        assert value <= 0 and 1 <= len(top) <= body["logprobs"] + 1


def _chat_logprobs(answer: Answer, body: Body, baseline: Answer) -> None:
    assert answer.logprobs is not None
    content = answer.logprobs["content"]
    assert len(content) == len(answer.tokens)
    for entry in content:
        assert entry["logprob"] <= 0 and isinstance(entry["bytes"], list)
        assert len(entry["top_logprobs"]) == body.get("top_logprobs", 0)


def _greedy(body: Body) -> bool:
    """Whether the body leaves one token to draw at each step: temperature 0, top_k 1,
    or a top_p smaller than any token's probability (the most likely token is kept)."""
    tiny_nucleus = body.get("top_p", 1.0) < 1e-6
    return body.get("temperature", 1.0) == 0 or body.get("top_k") == 1 or tiny_nucleus


def _limit(body: Body) -> int:
    limit = body.get("max_tokens", body.get("max_completion_tokens", MAX_TOKENS))
    assert isinstance(limit, int)
    return limit


FIELDS: dict[str, Field] = {
    "model": Field({"model": "small"}, _nothing),
    "max_tokens": Field({"max_tokens": 5}, _max_tokens),
    "temperature": Field({"temperature": 0.8, "seed": 11}, _nothing),
    # A nucleus of one token: the answer must be the greedy one (_assert_greedy_prefix).
    "top_p": Field({"top_p": 1e-9, "temperature": 1.0, "seed": 12}, _nothing),
    "top_k": Field({"top_k": 3, "temperature": 1.0, "seed": 13}, _nothing),
    "seed": Field({"seed": 7, "temperature": 1.0}, _seed),
    "stop": Field({"stop": ["<set from the baseline>"]}, _stop),
    "stop_token_ids": Field({"stop_token_ids": [-1]}, _stop_token_ids),
    "stream": Field({"stream": True}, _nothing),
    "stream_options": Field({"stream_options": {"include_usage": True}}, _stream_options),
    "ignore_eos": Field({"ignore_eos": True}, _ignore_eos),
    "min_tokens": Field({"min_tokens": 3}, _min_tokens),
    "n": Field({"n": 2}, _n),
    "presence_penalty": Field({"presence_penalty": 0.0}, _nothing),
    "frequency_penalty": Field({"frequency_penalty": 0.0}, _nothing),
    "user": Field({"user": "someone"}, _nothing),
}
COMPLETION_ONLY = {
    "echo": Field({"echo": True}, _echo),
    "logprobs": Field({"logprobs": 2}, _completion_logprobs),
}
CHAT_ONLY = {
    "max_completion_tokens": Field({"max_completion_tokens": 3}, _max_completion_tokens),
    "logprobs": Field({"logprobs": True}, _chat_logprobs),
    "top_logprobs": Field({"logprobs": True, "top_logprobs": 2}, _chat_logprobs),
}


def bodies(fields: dict[str, Field]) -> list[tuple[tuple[str, ...], Body]]:
    """Each field alone, and each pair of fields."""
    names = list(fields)
    combos: list[tuple[str, ...]] = [(name,) for name in names]
    combos += itertools.combinations(names, 2)
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
    prompt_tokens = len(tokenizer.encode(PROMPT))
    async with aiohttp.ClientSession() as session:
        status, payload = await post(session, url, {**base, "ignore_eos": True})
        assert status == 200, payload
        (baseline,) = read_answers(chat, base, payload)
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
                answers = read_answers(chat, body, payload, prompt_tokens)
                for answer in answers:
                    for name in combo:
                        fields[name].check(answer, body, baseline)
                    _assert_greedy_prefix(combo, body, answer, baseline)
                if "seed" in body and body.get("temperature"):
                    repeated = (await post(session, url, body))[1]
                    again = read_answers(chat, body, repeated, prompt_tokens)
                    assert [a.tokens for a in again] == [a.tokens for a in answers], combo

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
    assert sent == 2 * (18 + 18 * 17 // 2)  # 16 common fields, echo and logprobs


def test_every_chat_field_alone_and_in_pairs(worker: ServerProcess, small_model_dir: Path) -> None:
    sent = asyncio.run(run_matrix(worker, True, Tokenizer.from_dir(small_model_dir)))
    assert sent == 2 * (19 + 19 * 18 // 2)  # 16 common, max_completion_tokens, logprobs x2


# -- what the sampling fields do -------------------------------------------------------


async def _tokens(worker: ServerProcess, **fields: Any) -> list[int]:
    """The generated tokens of a 16-token completion of PROMPT with `fields`."""
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession() as session:
        status, payload = await post(session, f"{worker.url}/v1/completions", body | fields)
    assert status == 200, payload
    tokens: list[int] = payload["choices"][0]["token_ids"]
    return tokens


def test_sampling_fields_change_what_is_drawn(worker: ServerProcess) -> None:
    """With the same seed, a sampler that ignored a field would draw the same tokens:
    each field must change them, and its limit case must be the greedy answer."""
    greedy = asyncio.run(_tokens(worker, temperature=0))
    seeded = asyncio.run(_tokens(worker, temperature=1.0, seed=5))
    assert seeded != greedy
    sampled: dict[str, Any] = {"temperature": 1.0, "seed": 5}
    for fields in ({"temperature": 4.0}, {"top_p": 0.5}, {"top_k": 3}):
        assert asyncio.run(_tokens(worker, **(sampled | fields))) != seeded, fields
    for limit in ({"temperature": 1e-6}, {"top_p": 1e-9}, {"top_k": 1}):
        assert asyncio.run(_tokens(worker, **(sampled | limit))) == greedy, limit


def test_top_k_draws_only_among_the_k_most_likely(worker: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "logprobs": 3}
    fields = {"temperature": 1.0, "seed": 9, "top_k": 3}

    async def send() -> Any:
        async with aiohttp.ClientSession() as session:
            return await post(session, f"{worker.url}/v1/completions", body | fields)

    status, payload = asyncio.run(send())
    assert status == 200, payload
    logprobs = payload["choices"][0]["logprobs"]
    # Raw log-probabilities: each drawn token must be one of its step's three most
    # likely tokens (the alternatives listed), never one further down.
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        ranked = sorted(top.items(), key=lambda item: -item[1])
        assert token in dict(ranked[:3]), (token, top)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_are_refused_rather_than_ignored(worker: ServerProcess, field: str) -> None:
    async def send() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": PROMPT, "max_tokens": 2, field: 0.5}
            return await post(session, f"{worker.url}/v1/completions", body)

    status, payload = asyncio.run(send())
    assert status == 400
    assert field in payload["error"]["message"]


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


def test_openapi_describes_every_endpoint(worker: ServerProcess) -> None:
    async def fetch() -> Any:
        url = f"{worker.url}/openapi.json"
        async with aiohttp.ClientSession() as session, session.get(url) as answer:
            return await answer.json()

    spec = asyncio.run(fetch())
    expected = {
        "/v1/completions": {"max_tokens", "stop", "min_tokens", "stream", "n", "logprobs", "echo"},
        "/v1/chat/completions": {"max_tokens", "stream", "n", "logprobs", "top_logprobs"},
        "/tokenize": {"prompt", "messages", "add_special_tokens", "return_token_strs"},
        "/detokenize": {"tokens"},
    }
    for path, fields in expected.items():
        schema_ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = schema_ref["schema"]["$ref"].rsplit("/", 1)[1]
        properties = spec["components"]["schemas"][name]["properties"]
        assert fields <= set(properties), path
