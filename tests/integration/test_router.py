"""The router in front of a pool run by the local backend (the very command lines the
operator renders): one prefill and one decode worker; prompts of up to 64 tokens are
served colocated, longer ones disaggregated. The `openai` client on both paths, the
bucket boundary, the trusted internal path, client API keys, the routing file's
reloads, and a client that goes away."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import aiohttp
import openai
import pytest

from pdserve.base.process import pdserve_command
from pdserve.operator.local.pool import LocalPool
from pdserve.protocol.headers import (
    PREFILL_URL_HEADER,
    PROMPT_TOKEN_IDS_FIELD,
    PROMPT_TOKENIZER_HEADER,
)
from pdserve.protocol.internal import bearer
from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.model.tokenizer import Tokenizer
from support.engine import make_engine, run_to_completion
from support.network import witness
from support.prom import total
from support.router import (
    BOUNDARY,
    as_router,
    known_workers,
    local_pool,
    pool_manifest,
    router_metric,
    running_router,
    worker_load,
)
from support.waiting import wait_until

MAX_TOKENS = 12


class Sampling(TypedDict):
    """Sampling arguments of the client's create calls (typed, so they unpack into it)."""

    temperature: float
    max_tokens: int


GREEDY: Sampling = {"temperature": 0, "max_tokens": MAX_TOKENS}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def pool(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPool]:
    manifest = pool_manifest("routed", small_model_dir)
    with local_pool(manifest, tmp_path_factory.mktemp("pool")) as started:
        yield started


@pytest.fixture(scope="module")
def client(pool: LocalPool) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pool.url}/v1", api_key="unused", max_retries=0)


def decode_url(pool: LocalPool) -> str:
    return pool.workers["decode"][0].url


def prefill_url(pool: LocalPool) -> str:
    return pool.workers["prefill"][0].url


def worker_total(url: str, name: str, **labels: str) -> float:
    return total(f"{url}/metrics", name, **labels)


def credential(pool: LocalPool) -> str:
    return pool.credential_file.read_text().strip()


def streamed_tokens(stream: Any) -> list[int]:
    tokens: list[int] = []
    for chunk in stream:
        for choice in chunk.choices:
            tokens += (choice.model_extra or {}).get("token_ids") or []
    return tokens


def both_paths(model_dir: Path, first_token: int) -> list[tuple[list[int], list[int], str]]:
    """A prompt at the colocated bucket's limit and one far beyond it, each with its
    greedy tokens from an engine of its own and the mode the router should pick."""
    short = list(range(first_token, first_token + BOUNDARY))
    long = list(range(first_token, first_token + 300))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected, _ = run_to_completion(make_engine(model_dir), [short, long], params)
    return [(short, expected[0], "colocated"), (long, expected[1], "disaggregated")]


def test_openai_client_gets_the_colocated_answer_on_both_paths(
    pool: LocalPool, client: openai.OpenAI, small_model_dir: Path
) -> None:
    paths = both_paths(small_model_dir, first_token=10)
    short = paths[0][0]
    for prompt, want, mode in paths:
        raw = client.completions.with_raw_response.create(
            model="small", prompt=prompt, extra_body=EXTRA, **GREEDY
        )
        assert raw.headers["X-Pdserve-Mode"] == mode
        whole = raw.parse()
        assert (whole.choices[0].model_extra or {})["token_ids"] == want
        stream = client.completions.create(
            model="small", prompt=prompt, stream=True, extra_body=EXTRA, **GREEDY
        )
        assert streamed_tokens(stream) == want
    # Chat: the router's answer, on either path, is the decode worker's own colocated one.
    direct = openai.OpenAI(  # as the router calls it: with the pool's credential
        base_url=f"{decode_url(pool)}/v1", api_key=credential(pool), max_retries=0
    )
    for words, mode in ((3, "colocated"), (150, "disaggregated")):
        messages: Any = [{"role": "user", "content": "tell me more " * words}]
        want = (
            direct.chat.completions.create(
                model="small", messages=messages, extra_body=EXTRA, **GREEDY
            )
            .choices[0]
            .model_extra
            or {}
        )["token_ids"]
        raw_chat = client.chat.completions.with_raw_response.create(
            model="small", messages=messages, extra_body=EXTRA, **GREEDY
        )
        assert raw_chat.headers["X-Pdserve-Mode"] == mode
        assert (raw_chat.parse().choices[0].model_extra or {})["token_ids"] == want
        chat_stream = client.chat.completions.create(
            model="small", messages=messages, stream=True, extra_body=EXTRA, **GREEDY
        )
        assert streamed_tokens(chat_stream) == want
    # vLLM's users name the model by the path it was loaded from, too (router and workers).
    for server in (client, direct):
        by_path = server.completions.create(model=str(small_model_dir), prompt=short, **GREEDY)
        assert by_path.usage is not None and by_path.usage.completion_tokens == MAX_TOKENS
    # A client's request id comes back (the workers saw ids of the router's own).
    echoed = client.completions.with_raw_response.create(
        model="small", prompt=short, extra_headers={"X-Request-Id": "client-7"}, **GREEDY
    )
    assert echoed.headers["X-Request-Id"] == "client-7"
    assert [m.id for m in client.models.list().data] == ["small"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=short, **GREEDY)


def test_underflowing_temperature_and_top_p_stop_no_engine_on_either_path(
    pool: LocalPool, client: openai.OpenAI, small_model_dir: Path
) -> None:
    # Once answered "engine_stopped" and left the prefill and the decode engine dead:
    # in float32 both are 0 (a division by zero, a nucleus of nothing).
    paths = both_paths(small_model_dir, first_token=20)
    for prompt, want, mode in paths:
        for temperature in (1e-300, 5e-324):
            raw = client.completions.with_raw_response.create(
                model="small", prompt=prompt, temperature=temperature, max_tokens=MAX_TOKENS,
                extra_body=EXTRA,
            )  # fmt: skip
            assert raw.headers["X-Pdserve-Mode"] == mode
            # Below the floor a temperature is greedy.
            assert (raw.parse().choices[0].model_extra or {})["token_ids"] == want
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client.completions.create(
                model="small", prompt=prompt, top_p=1e-300, temperature=1.0, max_tokens=4
            )
    for url in (decode_url(pool), prefill_url(pool)):
        assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
    short, want, _ = paths[0]
    again = client.completions.create(model="small", prompt=short, extra_body=EXTRA, **GREEDY)
    assert (again.choices[0].model_extra or {})["token_ids"] == want


# Numbers at the extremes of float64 and float32, as JSON numbers and as strings.
EXTREMES: list[Any] = [
    5e-324, 1e-310, 1e-300, 1e-46, 1e-40, -0.0, 3.5e38, 1e300, float("nan"), float("inf"),
    float("-inf"), "NaN", "Infinity", "-Infinity", "1e-300", "5e-324", "-0.0", "1e300",
]  # fmt: skip
NUMERIC_FIELDS = (
    "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "n", "seed", "logprobs",
    "presence_penalty",
)  # fmt: skip


def test_numbers_at_their_extremes_get_an_answer_or_a_4xx_on_either_path(pool: LocalPool) -> None:
    short, long = list(range(30, 40)), list(range(30, 30 + 2 * BOUNDARY))

    async def send_all() -> list[tuple[int, str]]:
        limit = asyncio.Semaphore(16)
        async with aiohttp.ClientSession() as session:

            async def one(body: dict[str, Any]) -> tuple[int, str]:
                async with limit:
                    data = json.dumps(body).encode()  # NaN and Infinity as JSON numbers
                    async with session.post(
                        f"{pool.url}/v1/completions", data=data,
                        headers={"Content-Type": "application/json"},
                    ) as answer:  # fmt: skip
                        return answer.status, await answer.text()

            bodies = [
                {"prompt": prompt, "max_tokens": 2, "stream": stream, field: value}
                for prompt in (short, long)
                for field in NUMERIC_FIELDS
                for value in EXTREMES
                for stream in (False, True)
            ]
            return list(await asyncio.gather(*(one(body) for body in bodies)))

    answers = asyncio.run(send_all())
    assert [a for a in answers if a[0] >= 500 or ('"error"' in a[1] and a[0] == 200)] == []
    assert {status for status, _ in answers} <= {200, 400}
    for url in (decode_url(pool), prefill_url(pool)):
        assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
    wait_until(
        lambda: (
            worker_total(decode_url(pool), "pdserve_kv_cache_usage_ratio") == 0.0
            and worker_total(prefill_url(pool), "pdserve_kv_cache_usage_ratio") == 0.0
        ),
        60,
        "empty caches",
    )


def test_prompts_at_the_boundary_take_the_intended_path(
    pool: LocalPool, client: openai.OpenAI
) -> None:
    def counts() -> tuple[float, ...]:
        return (
            router_metric(pool, "pdserve_router_decisions_total", bucket="le64", mode="colocated"),
            router_metric(
                pool, "pdserve_router_decisions_total", bucket="gt64", mode="disaggregated"
            ),
            worker_total(
                decode_url(pool), "pdserve_time_to_first_token_seconds_count", mode="colocated"
            ),
            worker_total(
                decode_url(pool), "pdserve_time_to_first_token_seconds_count", mode="disaggregated"
            ),
            worker_total(prefill_url(pool), "pdserve_kv_transfer_bytes_total"),
        )

    before = counts()
    client.completions.create(model="small", prompt=list(range(10, 10 + BOUNDARY)), **GREEDY)
    after_under = counts()
    client.completions.create(model="small", prompt=list(range(10, 11 + BOUNDARY)), **GREEDY)
    after_over = counts()
    assert [a - b for a, b in zip(after_under[:4], before[:4], strict=True)] == [1, 0, 1, 0]
    assert after_under[4] == before[4]  # the prefill worker moved nothing
    assert [a - b for a, b in zip(after_over[:4], after_under[:4], strict=True)] == [0, 1, 0, 1]
    assert after_over[4] > after_under[4]
    # Chat prompts are measured as the worker measures them: with the chat template.
    seen = set()
    for words in range(20, 28):
        messages: Any = [{"role": "user", "content": "word " * words}]
        raw = client.chat.completions.with_raw_response.create(
            model="small", messages=messages, max_tokens=1
        )
        answer = raw.parse()
        assert answer.usage is not None
        bucket = "le64" if answer.usage.prompt_tokens <= BOUNDARY else "gt64"
        assert raw.headers["X-Pdserve-Bucket"] == bucket
        seen.add(bucket)
    assert seen == {"le64", "gt64"}


async def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers or {}) as answer,
    ):
        return answer.status, await answer.json(content_type=None)


def test_the_router_tokenizes_as_the_workers(pool: LocalPool) -> None:
    # The tiny model's byte-level tokenizer: some tokens hold part of a character.
    text = "Café naïve 😀 你好 — 42"
    routers, workers = pool.url, decode_url(pool)
    prompt = {"prompt": text, "return_token_strs": True}
    chat = {"messages": [{"role": "user", "content": text}]}
    for body in (prompt, chat):
        answer = asyncio.run(post(f"{routers}/tokenize", body))
        as_worker = asyncio.run(post(f"{workers}/tokenize", body, as_router(pool)))
        assert answer[0] == 200 and answer == as_worker
    _, tokens = asyncio.run(post(f"{routers}/tokenize", prompt))
    assert asyncio.run(post(f"{routers}/detokenize", {"tokens": tokens["tokens"]})) == (
        200, {"prompt": text},
    )  # fmt: skip


def test_the_worker_takes_the_routers_token_ids_only_as_its_own(
    pool: LocalPool, small_model_dir: Path
) -> None:
    """The router sends its token ids with the prompt (the worker does not tokenize it
    again): the answers are the worker's own, echo, logprobs and usage included; a
    worker takes ids only from the pool's router, and only from its own tokenizer."""
    text = "Café naïve 😀 你好 — 42 " * 3
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        routed = asyncio.run(post(f"{pool.url}{path}", request))
        direct = asyncio.run(post(f"{decode_url(pool)}{path}", request, as_router(pool)))
        assert routed[0] == direct[0] == 200, routed
        for answer in (routed[1], direct[1]):
            for key in ("id", "created", "system_fingerprint"):
                answer.pop(key, None)
            answer["usage"].pop("prompt_tokens_details", None)  # the second finds it cached
        assert routed == direct
    tokenizer = Tokenizer.from_dir(small_model_dir)
    prompt_tokens = len(tokenizer.encode(text))
    other = tokenizer.encode("something else entirely")
    sent = {**body, PROMPT_TOKEN_IDS_FIELD: other}
    completions = f"{decode_url(pool)}/v1/completions"
    # From the router, with its tokenizer's fingerprint: the ids are the prompt's.
    as_its_own = {PROMPT_TOKENIZER_HEADER: tokenizer.fingerprint, **as_router(pool)}
    status, answer = asyncio.run(post(completions, sent, as_its_own))
    assert status == 200 and answer["usage"]["prompt_tokens"] == len(other)
    assert answer["choices"][0]["text"].startswith(text)  # echo is the client's text
    # Another tokenizer's ids: the worker tokenizes the prompt itself.
    foreign = {PROMPT_TOKENIZER_HEADER: "0" * 32, **as_router(pool)}
    status, answer = asyncio.run(post(completions, sent, foreign))
    assert status == 200 and answer["usage"]["prompt_tokens"] == prompt_tokens
    # Without the pool's credential: refused; ids that are not ids: a 400.
    status, answer = asyncio.run(post(completions, sent, {PROMPT_TOKENIZER_HEADER: "0" * 32}))
    assert status == 401
    bad = {**body, PROMPT_TOKEN_IDS_FIELD: ["a"]}
    assert asyncio.run(post(completions, bad, as_its_own))[0] == 400


def test_a_client_cannot_make_a_worker_connect_where_it_chooses(pool: LocalPool) -> None:
    body = {"prompt": list(range(10, 200)), "max_tokens": 2}
    failures = worker_total(decode_url(pool), "pdserve_kv_transfer_failures_total")
    with witness() as attacker:
        named = {PREFILL_URL_HEADER: attacker.url}
        # To the router: the header is not passed on; the request is served.
        status, answer = asyncio.run(post(f"{pool.url}/v1/completions", body, named))
        assert status == 200, answer
        # Straight to a worker, without the pool's credential (or with a wrong one): 401.
        decode = f"{decode_url(pool)}/v1/completions"
        status, answer = asyncio.run(post(decode, body, named))
        assert (status, answer["error"]["code"]) == (401, "invalid_credential")
        # Nor any request at all: the router's keys and limits cannot be bypassed.
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            status, answer = asyncio.run(post(f"{decode_url(pool)}{path}", {"prompt": "hi"}))
            assert (status, answer["error"]["code"]) == (401, "invalid_credential"), path
            assert "served to the pool's router only" in answer["error"]["message"]
        status, _ = asyncio.run(post(decode, body, {**named, **bearer("x" * 43)}))
        assert status == 401
        # With the credential, but not one of the pool's prefill workers: 403.
        status, answer = asyncio.run(post(decode, body, {**named, **bearer(credential(pool))}))
        assert (status, answer["error"]["code"]) == (403, "forbidden")
        assert "not one of this pool's prefill workers" in answer["error"]["message"]
        assert attacker.connections() == 0
    assert worker_total(decode_url(pool), "pdserve_kv_transfer_failures_total") == failures
    for path in ("/pd/connect", "/pd/prefill"):
        for headers in ({}, bearer("y" * 43)):
            status, answer = asyncio.run(post(f"{prefill_url(pool)}{path}", {}, headers))
            assert (status, answer["error"]["code"]) == (401, "invalid_credential"), path


def test_client_api_keys(pool: LocalPool, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nsk-first\nsk-second\n")
    args = ("--internal-token-file", str(pool.credential_file), "--api-key-file", str(keys))
    with running_router(pool.routing_file, tmp_path / "router.log", *args) as router:
        router.wait_ready()
        wrong = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-third", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.completions.create(model="small", prompt=[5, 6], **GREEDY)
        assert refused.value.code == "invalid_api_key"
        status, answer = asyncio.run(post(f"{router.url}/v1/completions", {"prompt": [5]}))
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
        assert "didn't provide an API key" in answer["error"]["message"]
        allowed = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-second", max_retries=0)
        answer = allowed.completions.create(model="small", prompt=[5, 6], **GREEDY)
        assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
        # The tokenizer's endpoints cost the router CPU as completions do: keys too.
        status, answer = asyncio.run(post(f"{router.url}/tokenize", {"prompt": "hi"}))
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
        key = {"Authorization": "Bearer sk-first"}
        status, answer = asyncio.run(post(f"{router.url}/tokenize", {"prompt": "hi"}, key))
        assert status == 200 and answer["count"] > 0
        assert router_metric(router, "pdserve_requests_rejected_total", reason="invalid") == 3


def test_a_malformed_routing_file_is_refused_at_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "routing.json"
    bad.write_text('{"pool": "p", "model": {"name": "m", "path": "/m"}, "buckets": []}')
    started = subprocess.run(
        pdserve_command("router", "--config", str(bad), "--port", "0"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 2
    assert "routing.json: buckets: Tuple should have at least 1 item" in started.stderr
    assert "discovery: Field required" in started.stderr


def test_a_malformed_routing_file_is_refused_at_reload(pool: LocalPool, tmp_path: Path) -> None:
    routing = tmp_path / "routing.json"
    shutil.copy(pool.routing_file, routing)
    table = json.loads(routing.read_text())
    args = ("--internal-token-file", str(pool.credential_file))
    prompt = {"prompt": list(range(10, 110)), "max_tokens": 1}  # 100 tokens

    with running_router(routing, tmp_path / "router.log", *args) as router:
        router.wait_ready()

        def bucket() -> str:
            async def one() -> str:
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(f"{router.url}/v1/completions", json=prompt) as answer,
                ):
                    assert answer.status == 200
                    return (
                        f"{answer.headers['X-Pdserve-Bucket']} {answer.headers['X-Pdserve-Mode']}"
                    )

            return asyncio.run(one())

        assert bucket() == "gt64 disaggregated"
        table["buckets"] = [
            {"maxInputTokens": 128, "mode": "colocated"},
            {"maxInputTokens": 64, "mode": "disaggregated"},
        ]
        routing.write_text(json.dumps(table))
        wait_until(
            lambda: router_metric(router, "pdserve_router_config_reloads_total", result="refused"),
            30, "the malformed routing file to be refused",
        )  # fmt: skip
        assert "maxInputTokens must be strictly ascending" in router.log()
        assert bucket() == "gt64 disaggregated"  # the table in force stays
        table["buckets"] = [
            {"maxInputTokens": 128, "mode": "colocated"},
            {"maxInputTokens": None, "mode": "disaggregated"},
        ]
        routing.write_text(json.dumps(table))
        wait_until(
            lambda: router_metric(router, "pdserve_router_config_reloads_total", result="applied"),
            30, "the new routing file to be applied",
        )  # fmt: skip
        assert bucket() == "le128 colocated"


def test_a_client_that_goes_away_cancels_the_workers_request(pool: LocalPool) -> None:
    decode = decode_url(pool)
    aborted = worker_total(decode, "pdserve_requests_total", finish_reason="abort")

    async def read_a_little_then_leave() -> None:
        body = {
            "prompt": list(range(10, 40)),
            "max_tokens": 500,
            "stream": True,
            "ignore_eos": True,
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{pool.url}/v1/completions", json=body) as response,
        ):
            for _ in range(3):
                await response.content.readline()

    asyncio.run(read_a_little_then_leave())
    wait_until(
        lambda: worker_total(decode, "pdserve_requests_total", finish_reason="abort") > aborted,
        30, "the decode worker to abort the request",
    )  # fmt: skip
    wait_until(lambda: worker_load(decode)["in_flight"] == 0, 30, "the decode worker to be idle")
    assert known_workers(pool.url)["decode"][0]["in_flight"] == 0
