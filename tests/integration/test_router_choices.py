"""Log-probabilities, echo, n and the tokenizer's endpoints through the router, on both
paths of a local pool (prompts of up to 64 tokens served colocated, longer ones
disaggregated), on a checkpoint whose tokenizer is Llama-2's kind (SentencePiece
pieces, byte fallback, a BOS the tokenizer adds): scores against transformers, seeded
choices against single requests, one KV transfer for n choices, streams the `openai`
client parses, and the router's metrics counting choices and echoed prompts right."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch
from transformers import AutoTokenizer

from pdserve.operator import api
from pdserve.operator.local.pool import LocalPool
from support.prom import total
from support.router import BOUNDARY, as_router, local_pool, pool_manifest, router_metric
from support.scoring import LOGPROB_ATOL, reference_logprobs, reference_model
from support.waiting import wait_until

N = 4
MODES = ("colocated", "disaggregated")
TRANSFERS = "pdserve_kv_transfer_duration_seconds_count"
# A sentence of the kind an evaluation harness scores, and a continuation of it.
SENTENCE = "The prefill worker writes the prompt's blocks; the decode worker reads them. "
CONTINUATION = " Both agree on every token."


@pytest.fixture(scope="module")
def pool(llama_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPool]:
    manifest = pool_manifest("choices", llama_model_dir)
    with local_pool(manifest, tmp_path_factory.mktemp("pool")) as started:
        yield started


@pytest.fixture(scope="module")
def client(pool: LocalPool) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pool.url}/v1", api_key="unused", max_retries=0)


def worker_url(pool: LocalPool, role: api.Role) -> str:
    return pool.workers[role][0].url


def worker_total(pool: LocalPool, role: api.Role, name: str) -> float:
    return total(f"{worker_url(pool, role)}/metrics", name)


def prompt_ids(seed: int, mode: str) -> list[int]:
    """A prompt not seen before (no cached blocks) that the router sends down `mode`."""
    length = 40 if mode == "colocated" else 90
    assert (length <= BOUNDARY) == (mode == "colocated")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 850, (length,), generator=generator).tolist()


def context(mode: str) -> str:
    """Text of about 30 tokens (colocated) or 160 (disaggregated)."""
    return SENTENCE * (1 if mode == "colocated" else 5)


async def _post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.json(content_type=None)


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    status, answer = asyncio.run(_post(url, body, headers))
    assert status == 200, answer
    return answer


@pytest.mark.parametrize("mode", MODES)
def test_scoring_through_the_router_equals_transformers(
    pool: LocalPool, client: openai.OpenAI, llama_model_dir: Path, mode: str
) -> None:
    # As an evaluation harness scores a continuation: echo the context and the
    # continuation with their log-probabilities, generate nothing, and sum the
    # continuation's (its tokens: those the whole has beyond the context's).
    whole = context(mode) + CONTINUATION
    ids = post(f"{pool.url}/tokenize", {"prompt": whole})["tokens"]
    continuation = len(ids) - post(f"{pool.url}/tokenize", {"prompt": context(mode)})["count"]
    assert ids == AutoTokenizer.from_pretrained(llama_model_dir)(whole).input_ids
    assert ids[0] == 1 and continuation > 1  # the BOS, and several tokens to score
    raw = client.completions.with_raw_response.create(
        model="small", prompt=whole, max_tokens=0, echo=True, logprobs=1
    )
    assert raw.headers["X-Pdserve-Mode"] == mode
    scored = raw.parse()
    choice = scored.choices[0]
    assert choice.text == whole and scored.usage is not None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    values = choice.logprobs.token_logprobs
    assert len(values) == len(ids) and values[0] is None
    expected = reference_logprobs(reference_model(llama_model_dir), ids)
    reference = [expected[position - 1, ids[position]].item() for position in range(1, len(ids))]
    assert max(abs(v - r) for v, r in zip(values[1:], reference, strict=True)) < LOGPROB_ATOL
    # The log-likelihood of the continuation, within the tolerance of each of its terms.
    log_likelihood = sum(reference[-continuation:])
    assert abs(sum(values[-continuation:]) - log_likelihood) < continuation * LOGPROB_ATOL

    # Streamed, the same values; the router counts the request and no generated token.
    ok = answered(pool, mode)
    ttft = router_metric(pool, "pdserve_time_to_first_token_seconds_count", mode=mode)
    chunks = list(
        client.completions.create(
            model="small", prompt=whole, max_tokens=0, echo=True, logprobs=1, stream=True
        )
    )
    streamed = [
        value
        for chunk in chunks
        for piece in chunk.choices
        for value in (piece.logprobs.token_logprobs or [] if piece.logprobs else [])
    ]
    assert streamed == values
    wait_recorded(pool, mode, ok + 1)
    assert answered(pool, mode) == ok + 1
    assert router_metric(pool, "pdserve_time_to_first_token_seconds_count", mode=mode) == ttft


@pytest.mark.parametrize("mode", MODES)
def test_seeded_choices_through_the_router(
    pool: LocalPool, client: openai.OpenAI, mode: str
) -> None:
    prompt = prompt_ids(11 if mode == "colocated" else 12, mode)
    common: dict[str, Any] = {
        "model": "small", "prompt": prompt, "max_tokens": 12, "temperature": 1.0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }  # fmt: skip
    transfers = worker_total(pool, "prefill", TRANSFERS), worker_total(pool, "decode", TRANSFERS)
    allocated = worker_total(pool, "decode", "pdserve_kv_blocks_allocated_total")
    raw = client.completions.with_raw_response.create(**common, n=N, seed=30)
    assert raw.headers["X-Pdserve-Mode"] == mode
    many = raw.parse()
    moved = 1 if mode == "disaggregated" else 0
    assert (
        worker_total(pool, "prefill", TRANSFERS),
        worker_total(pool, "decode", TRANSFERS),
    ) == (transfers[0] + moved, transfers[1] + moved)
    # On the decode worker, the prompt's blocks once (16 tokens a block, the last one
    # partial), a copy of that partial block for each choice but the first, and each
    # choice's blocks for the KV of its tokens past the prompt's blocks (a prompt of
    # 40 tokens: 3 blocks, then one more by position 50; of 90: 6, then one by 100).
    prompt_blocks = -(-len(prompt) // 16)
    assert (
        worker_total(pool, "decode", "pdserve_kv_blocks_allocated_total") - allocated
        == prompt_blocks + (N - 1) + N
    )
    assert worker_total(pool, "decode", "pdserve_kv_cache_usage_ratio") == 0.0
    # Choice i draws as a single request seeded 30 + i does.
    choices = [(choice.model_extra or {})["token_ids"] for choice in many.choices]
    singles = [
        (client.completions.create(**common, seed=30 + index).choices[0].model_extra or {})[
            "token_ids"
        ]
        for index in range(N)
    ]
    assert choices == singles and len({tuple(tokens) for tokens in choices}) > 1
    assert many.usage is not None and many.usage.completion_tokens == 12 * N


def answered(pool: LocalPool, mode: str) -> float:
    """Requests the router has recorded as answered on `mode`'s path."""
    return router_metric(pool, "pdserve_router_requests_total", outcome="ok", mode=mode)


def wait_recorded(pool: LocalPool, mode: str, count: float) -> None:
    """Until the router has recorded `count` answered requests (it records a stream once
    it has relayed the end, which the client may read first)."""
    wait_until(lambda: answered(pool, mode) >= count, 30, f"{count} requests recorded")


def _counts(pool: LocalPool, mode: str) -> tuple[float, ...]:
    return tuple(
        router_metric(pool, f"pdserve_{name}_seconds_count", mode=mode)
        for name in ("time_to_first_token", "inter_token_latency", "time_per_output_token")
    )


@pytest.mark.parametrize("mode", MODES)
def test_streamed_choices_with_logprobs_parse_and_count(
    pool: LocalPool, client: openai.OpenAI, mode: str
) -> None:
    before, ok = _counts(pool, mode), answered(pool, mode)
    prompt = prompt_ids(21 if mode == "colocated" else 22, mode)
    common: dict[str, Any] = {
        "model": "small", "prompt": prompt, "max_tokens": 5, "n": 3, "seed": 2, "logprobs": 2,
        "echo": True, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    chunks = list(client.completions.create(**common, stream=True))
    whole = client.completions.create(**common)
    for index in range(3):
        pieces = [piece for chunk in chunks for piece in chunk.choices if piece.index == index]
        listed = [token for piece in pieces for token in (piece.logprobs.tokens or [])]
        assert "".join(piece.text for piece in pieces) == whole.choices[index].text
        assert listed == whole.choices[index].logprobs.tokens
        assert len(listed) == len(prompt) + 5  # the echoed prompt's tokens, then 5
    words = 3 if mode == "colocated" else 150
    stream = client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "tell me more " * words}],
        max_tokens=4, n=2, seed=8, logprobs=True, top_logprobs=2, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    entries = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            assert choice.logprobs is not None and choice.logprobs.content is not None
            for entry in choice.logprobs.content:
                assert len(entry.top_logprobs) == 2 and entry.bytes is not None
            entries[choice.index] += len(choice.logprobs.content)
    assert entries == {0: 4, 1: 4}
    # The router timed each choice's generated tokens, not the echoed prompt: one TTFT
    # and one TPOT per streamed request, and an ITL for each gap within a choice
    # (3 choices of 5 tokens, 2 of 4).
    wait_recorded(pool, mode, ok + 3)
    after = _counts(pool, mode)
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 3 * 4 + 2 * 3, 2]


def test_tokenize_on_the_router_as_on_the_workers(pool: LocalPool, llama_model_dir: Path) -> None:
    reference = AutoTokenizer.from_pretrained(llama_model_dir)
    text = "Café naïve 😀 — the prefill worker streams 42 tokens"
    messages = [{"role": "user", "content": text}]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    answers = {}
    # The worker as the router would call it (it serves nobody else).
    for url, headers in ((pool.url, {}), (worker_url(pool, "decode"), as_router(pool))):
        tokens = post(
            f"{url}/tokenize", {"model": "small", "prompt": text, "return_token_strs": True},
            headers,
        )  # fmt: skip
        assert tokens["tokens"] == reference(text).input_ids
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
        detokenized = post(f"{url}/detokenize", {"tokens": tokens["tokens"]}, headers)
        assert detokenized == {"prompt": text}
        chat = post(f"{url}/tokenize", {"messages": messages}, headers)
        assert chat["tokens"] == reference(rendered, add_special_tokens=False).input_ids
        answers[url] = (tokens, chat)
    assert len({repr(answer) for answer in answers.values()}) == 1
    for path, body, status in (
        ("/tokenize", {"prompt": "x", "model": "other"}, 404),
        ("/detokenize", {"tokens": [1, 10**6]}, 400),
        ("/tokenize", {"prompt": "x", "messages": messages}, 400),
    ):
        assert asyncio.run(_post(f"{pool.url}{path}", body))[0] == status
