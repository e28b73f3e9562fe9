"""OpenAI conformance of a worker and of the router, colocated and disaggregated, as
third-party clients see them: every answer of a request matrix (completions and chat,
streamed or not, n, echo, logprobs, errors, the model named or not) validates
against the response schema the server publishes at /openapi.json and parses with the
`openai` client's models, strictly; every completion and chunk names the model as the
client did. Unsupported methods get 405 with `Allow`. Clients that leave at any stage
leave each routed request counted under exactly one outcome, and are logged as such."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai.types import Completion, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from pdserve.operator.local.pool import LocalPool
from pdserve.protocol.internal import bearer
from support.conformance import PublishedApi, events, openai_misfits
from support.router import BOUNDARY, local_pool, pool_manifest, router_metric, worker_load
from support.waiting import wait_until

MAX_TOKENS = 4
SHORT = list(range(5, 21))
LONG = list(range(10, 11 + 2 * BOUNDARY))
SHORT_CHAT = [{"role": "user", "content": "tell me more " * 3}]
LONG_CHAT = [{"role": "user", "content": "tell me more " * 60}]
# Completions and chat completions with what changes their answers' shape.
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("/v1/completions", {}),
    ("/v1/completions", {"logprobs": 2}),
    ("/v1/completions", {"echo": True, "logprobs": 2}),
    ("/v1/completions", {"return_token_ids": True, "stop": ["\n"]}),
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2, "return_token_ids": True}),
)
WHOLE: dict[str, type[BaseModel]] = {
    "/v1/completions": Completion,
    "/v1/chat/completions": ChatCompletion,
}
# The openai client reads a completions stream's chunks as Completion objects.
CHUNK: dict[str, type[BaseModel]] = {
    "/v1/completions": Completion,
    "/v1/chat/completions": ChatCompletionChunk,
}


@dataclass(frozen=True)
class Target:
    """A server to ask, how it serves, and the prompts that make it serve so."""

    name: str
    url: str
    headers: dict[str, str]
    mode: str
    prompt: list[int]
    messages: list[dict[str, str]]


@pytest.fixture(scope="module")
def pool(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPool]:
    manifest = pool_manifest("conform", small_model_dir)
    with local_pool(manifest, tmp_path_factory.mktemp("pool")) as started:
        yield started


def worker_of(pool: LocalPool) -> Target:
    """The decode worker, asked directly (with the pool's credential, as the router)."""
    credential = bearer(pool.credential_file.read_text().strip())
    url = pool.workers["decode"][0].url
    return Target("worker", url, credential, "colocated", SHORT, SHORT_CHAT)


def targets(pool: LocalPool) -> list[Target]:
    return [
        worker_of(pool),
        Target("router", pool.url, {}, "colocated", SHORT, SHORT_CHAT),
        Target("router", pool.url, {}, "disaggregated", LONG, LONG_CHAT),
    ]


async def published(session: aiohttp.ClientSession, url: str) -> PublishedApi:
    async with session.get(f"{url}/openapi.json") as answer:
        assert answer.status == 200
        return PublishedApi(await answer.json())


@dataclass(frozen=True)
class Asked:
    """One request of the matrix."""

    target: Target
    path: str
    body: dict[str, Any]
    expected_model: str

    @property
    def allowed(self) -> tuple[str, ...]:
        return ("echo",) if self.body.get("echo") else ()


def matrix(pool: LocalPool, model_dir: Path) -> list[Asked]:
    names = itertools.cycle([(None, "small"), ("small", "small"), (str(model_dir),) * 2])
    asked = []
    for target, (path, extra), n, stream in itertools.product(
        targets(pool), VARIANTS, (1, 2), (False, True)
    ):
        body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "n": n, "stream": stream, **extra}
        if path == "/v1/completions":
            body["prompt"] = target.prompt
        else:
            body["messages"] = target.messages
        if stream:
            body["stream_options"] = {"include_usage": True}
        named, expected = next(names)
        if named is not None:
            body["model"] = named
        asked.append(Asked(target, path, body, expected))
    return asked


async def check(session: aiohttp.ClientSession, api: PublishedApi, asked: Asked) -> list[str]:
    """What is wrong with the answer to `asked` (nothing: an empty list)."""
    target, path, body = asked.target, asked.path, asked.body
    where = f"{target.name} {target.mode} {path} {body}"
    async with session.post(target.url + path, json=body, headers=target.headers) as answer:
        if answer.status != 200:
            return [f"{where}: HTTP {answer.status} {await answer.text()}"]
        if answer.headers.get("X-Pdserve-Mode") != target.mode:
            return [f"{where}: served {answer.headers.get('X-Pdserve-Mode')}"]
        if not body["stream"]:
            whole = await answer.json()
            api.check("post", path, 200, "application/json", whole)
            problems = openai_misfits(WHOLE[path], whole, asked.allowed)
            return [f"{where}: {problems}"] if problems else _named(where, [whole], asked)
        assert answer.content_type == "text/event-stream"
        sent = await events(answer)
    assert sent[-1] == "[DONE]", f"{where}: {sent[-1]}"
    chunks = sent[:-1]
    wrong: list[str] = []
    for chunk in chunks:
        api.check("post", path, 200, "text/event-stream", chunk)
        problems = openai_misfits(CHUNK[path], chunk, ("chunk", *asked.allowed))
        wrong += [f"{where}: {chunk}: {problems}"] if problems else []
    indexes = {choice["index"] for chunk in chunks for choice in chunk["choices"]}
    if indexes != set(range(body["n"])):
        wrong.append(f"{where}: choices {indexes}")
    if chunks[-1]["choices"] or chunks[-1].get("usage") is None:
        wrong.append(f"{where}: the last chunk is not the usage: {chunks[-1]}")
    return wrong + _named(where, chunks, asked)


def _named(where: str, bodies: list[dict[str, Any]], asked: Asked) -> list[str]:
    return [
        f"{where}: model {body.get('model')!r}, not {asked.expected_model!r}"
        for body in bodies
        if body.get("model") != asked.expected_model
    ]


def test_every_answer_follows_the_published_schema_and_the_openai_models(
    pool: LocalPool, small_model_dir: Path
) -> None:
    asked = matrix(pool, small_model_dir)

    async def run() -> list[str]:
        async with aiohttp.ClientSession() as session:
            apis = {url: await published(session, url) for url in {a.target.url for a in asked}}
            limit = asyncio.Semaphore(6)

            async def one(request: Asked) -> list[str]:
                async with limit:
                    return await check(session, apis[request.target.url], request)

            found = await asyncio.gather(*(one(request) for request in asked))
        return [problem for problems in found for problem in problems]

    problems = asyncio.run(run())
    assert not problems, "\n".join(problems)
    assert len(asked) == 3 * len(VARIANTS) * 4


async def exchange(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, str, Any, Mapping[str, str]]:
    async with session.request(method, url, json=body, headers=headers or {}) as answer:
        text = await answer.text()
        data = (
            await answer.json(content_type=None) if answer.content_type.endswith("json") else text
        )
        return answer.status, answer.content_type, data, answer.headers


def test_errors_models_tokenizer_and_probes_follow_the_published_schema(
    pool: LocalPool, small_model_dir: Path
) -> None:
    worker = worker_of(pool)
    servers = {
        "worker": (worker.url, worker.headers, "/load"),
        "router": (pool.url, {}, "/workers"),
    }
    asks: list[tuple[str, str, Any, int]] = [
        ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
        ("POST", "/v1/chat/completions", {"messages": []}, 400),
        ("POST", "/v1/completions", {"prompt": "hi", "model": "other"}, 404),
        ("GET", "/nowhere", None, 404),
        ("TRACE", "/v1/completions", None, 405),
        ("DELETE", "/health", None, 405),
        ("GET", "/v1/models", None, 200),
        ("POST", "/tokenize", {"prompt": "hello there"}, 200),
        ("POST", "/tokenize", {"messages": SHORT_CHAT, "return_token_strs": True}, 200),
        ("POST", "/detokenize", {"tokens": SHORT}, 200),
        ("GET", "/health", None, 200),
        ("GET", "/ready", None, 200),
        ("GET", "/openapi.json", None, 200),
        ("GET", "/metrics", None, 200),
    ]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            for name, (url, headers, own) in servers.items():
                api = await published(session, url)
                for method, path, body, status in [*asks, ("GET", own, None, 200)]:
                    got, media, data, answer_headers = await exchange(
                        session, method, url + path, body, headers
                    )
                    where = f"{name} {method} {path}"
                    assert got == status, (where, data)
                    api.check(method, path, got, media, data)
                    if got >= 400:
                        ErrorObject.model_validate(data["error"], strict=True)
                    if got == 405:
                        allowed = "POST" if path == "/v1/completions" else "GET,HEAD"
                        assert answer_headers["Allow"] == allowed, where
                        assert method in data["error"]["message"], where
                    if path == "/v1/models":
                        assert [Model.model_validate(m, strict=True).id for m in data["data"]] == [
                            "small"
                        ]

    asyncio.run(run())


async def leave(url: str, body: dict[str, Any], events_first: int, left: asyncio.Event) -> None:
    """Ask, read `events_first` events of the stream (none: not even its headers) and
    stay until cancelled; `left` is set once it has read them."""
    async with aiohttp.ClientSession() as session:
        if events_first == 0:
            left.set()
        async with session.post(f"{url}/v1/completions", json=body) as answer:
            read = 0
            while read < events_first:
                line = await answer.content.readline()
                read += line.startswith(b"data:")
            left.set()
            await asyncio.Event().wait()


def test_clients_that_leave_leave_every_routed_request_counted_once(pool: LocalPool) -> None:
    decode = pool.workers["decode"][0]
    # Long enough that no stream ends before its client leaves, on any machine.
    tokens = 1024 - len(LONG) - 8

    def outcomes(bucket: str, **labels: str) -> float:
        return router_metric(pool, "pdserve_router_requests_total", bucket=bucket, **labels)

    before = {b: outcomes(b, outcome="cancelled") for b in ("le64", "gt64")}

    async def run() -> None:
        for prompt in (SHORT, LONG):
            body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}
            for events_first in (0, 2):  # before the first byte; mid-stream
                left = asyncio.Event()
                client = asyncio.create_task(leave(pool.url, body, events_first, left))
                await left.wait()
                while events_first == 0 and worker_load(decode.url)["in_flight"] == 0:
                    await asyncio.sleep(0.05)  # until the decode worker holds the request
                client.cancel()
                await asyncio.gather(client, return_exceptions=True)
                await asyncio.to_thread(
                    wait_until, lambda: worker_load(decode.url)["in_flight"] == 0, 60,
                    "the decode worker to let the request go",
                )  # fmt: skip

    asyncio.run(run())
    for bucket in ("le64", "gt64"):
        decisions = router_metric(pool, "pdserve_router_decisions_total", bucket=bucket)

        def counted(b: str = bucket, d: float = decisions) -> bool:
            return outcomes(b) == d

        wait_until(counted, 60, f"{bucket}: every outcome")
        assert outcomes(bucket, outcome="cancelled") == before[bucket] + 2
    for process in (pool.router, decode):
        assert process is not None
        log = process.log()
        assert "the client went away" in log
        assert " ERROR " not in log and "Traceback" not in log, log
