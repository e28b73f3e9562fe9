"""Log-probabilities, echo, n and the tokenizer endpoints of a real worker, through
the `openai` client: the shapes clients parse, and the values against transformers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch

from pdserve.workers.model.tokenizer import Tokenizer
from support.scoring import LOGPROB_ATOL, reference_logprobs, reference_model
from support.worker import ServerProcess, metric, running_worker

pytestmark = pytest.mark.starts_first  # among the longest files of the run

N = 4
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ("--served-model-name", "small", "--max-model-len", "512")
    with running_worker(small_model_dir, tmp_path_factory.mktemp("logs"), *args) as process:
        yield process


@pytest.fixture(scope="module")
def client(worker: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(small_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(small_model_dir)


def prompt_ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers(
    client: openai.OpenAI, small_model_dir: Path, tokenizer: Tokenizer
) -> None:
    prompt = prompt_ids(21, 150)
    scored = client.completions.create(
        model="small", prompt=prompt, max_tokens=0, echo=True, logprobs=3
    )
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(prompt) and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == len(prompt)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference_logprobs(reference_model(small_model_dir), prompt)
    for position in range(1, len(prompt)):
        value = logprobs.token_logprobs[position]
        assert value is not None
        assert abs(value - expected[position - 1, prompt[position]].item()) < LOGPROB_ATOL
        # The prompt's token and the 3 most likely, by text (tokens alike in text,
        # such as parts of characters, share an entry).
        top = logprobs.top_logprobs[position]
        assert top is not None and len(top) <= 4
        assert top[logprobs.tokens[position]] == value
    offsets = logprobs.text_offset
    assert offsets is not None and offsets[0] == 0
    lengths = [len(token) for token in logprobs.tokens]
    assert offsets == [sum(lengths[:i]) for i in range(len(lengths))]
    assert scored.usage is not None and scored.usage.completion_tokens == 0


def test_completion_logprobs_follow_the_tokens(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="small", prompt="the quick brown fox", max_tokens=8, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.token_logprobs) == len((choice.model_extra or {})["token_ids"]) == 8
    rows = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for token, value, top in rows:
        assert value is not None and top is not None and value <= 0
        assert top[token] == value == max(top.values())  # greedy: the most likely token


def test_chat_logprobs_in_the_chat_shape(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    result = client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "hello there"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    token_ids = (choice.model_extra or {})["token_ids"]
    assert len(content) == len(token_ids) == 6
    for entry, token_id in zip(content, token_ids, strict=True):
        assert bytes(entry.bytes or []) == tokenizer.token_bytes(token_id)
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    assert "".join(bytes(e.bytes or []).decode("utf-8", "replace") for e in content)


def test_n_greedy_choices_share_the_prompt_blocks(
    worker: ServerProcess, client: openai.OpenAI
) -> None:
    prompt = prompt_ids(33, 90)  # 5 full blocks and a partial one; not seen before
    common: dict[str, Any] = {
        "model": "small", "prompt": prompt, "max_tokens": 10, "temperature": 0, "seed": 5,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }  # fmt: skip
    allocated = metric(worker, "pdserve_kv_blocks_allocated_total")
    many = client.completions.create(**common, n=N)
    # The prompt's 6 blocks once, a copy of the partial block for 3 choices, and each
    # choice's 7th block from token 96 on.
    assert metric(worker, "pdserve_kv_blocks_allocated_total") - allocated == 6 + (N - 1) + N
    assert metric(worker, "pdserve_kv_cache_usage_ratio") == 0.0
    single = client.completions.create(**common)
    assert [choice.index for choice in many.choices] == list(range(N))
    assert [choice.text for choice in many.choices] == [single.choices[0].text] * N
    assert many.usage is not None and many.usage.completion_tokens == 10 * N
    assert many.usage.prompt_tokens == len(prompt)


def test_seeded_choices_equal_single_requests_with_seed_plus_index(
    client: openai.OpenAI,
) -> None:
    prompt = prompt_ids(34, 40)
    common: dict[str, Any] = {"model": "small", "prompt": prompt, "max_tokens": 8, "top_p": 0.9}
    singles = [
        client.completions.create(**common, seed=70 + index, extra_body={"ignore_eos": True})
        for index in range(N)
    ]
    many = client.completions.create(**common, seed=70, n=N, extra_body={"ignore_eos": True})
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]


def test_streamed_choices_interleave_and_parse(client: openai.OpenAI) -> None:
    common: dict[str, Any] = {
        "model": "small", "prompt": "once upon a time", "max_tokens": 6, "seed": 9, "n": 3,
        "logprobs": 2, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    whole = client.completions.create(**common)
    chunks = list(client.completions.create(**common, stream=True))
    indices = [choice.index for chunk in chunks for choice in chunk.choices]
    assert sorted(set(indices)) == [0, 1, 2]
    assert indices[:3] == [0, 1, 2]  # one step's tokens, choice by choice
    for index in range(3):
        pieces = [c for chunk in chunks for c in chunk.choices if c.index == index]
        assert "".join(piece.text for piece in pieces) == whole.choices[index].text
        tokens = [t for piece in pieces for t in (piece.logprobs.tokens or [])]
        assert tokens == (whole.choices[index].logprobs.tokens or [])
        assert pieces[-1].finish_reason == "length"


def test_streamed_chat_with_n_and_logprobs_parses(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "tell me"}], max_tokens=5, n=2,
        seed=3, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    entries = {0: 0, 1: 0}
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.logprobs is not None and choice.logprobs.content is not None
            entries[choice.index] += len(choice.logprobs.content)
    assert entries == {0: 5, 1: 5}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_a_stop_string_ends_one_choice_not_the_others(client: openai.OpenAI) -> None:
    common: dict[str, Any] = {"model": "small", "prompt": "a b c", "max_tokens": 24, "seed": 1}
    free = client.completions.create(**common, n=3, extra_body={"ignore_eos": True})
    text = free.choices[1].text
    stop = text[8:11]
    assert stop.strip(), "the generated text is too short to pick a stop string"
    cut = client.completions.create(**common, n=3, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[1].text == text[: text.index(stop)]
    assert cut.choices[1].finish_reason == "stop"
    for index in (0, 2):
        original = free.choices[index].text
        expected = original[: original.index(stop)] if stop in original else original
        assert cut.choices[index].text == expected


def test_tokenize_and_detokenize(worker: ServerProcess, client: openai.OpenAI) -> None:
    text = "the quick brown fox"
    tokens = post(
        worker, "/tokenize", {"model": "small", "prompt": text, "return_token_strs": True}
    )
    completion = client.completions.create(model="small", prompt=text, max_tokens=1)
    assert completion.usage is not None and tokens["count"] == completion.usage.prompt_tokens
    assert tokens["max_model_len"] == 512 and len(tokens["token_strs"]) == tokens["count"]
    assert post(worker, "/detokenize", {"tokens": tokens["tokens"]}) == {"prompt": text}
    messages = [{"role": "user", "content": text}]
    chat = post(worker, "/tokenize", {"messages": messages})
    answer = client.chat.completions.create(
        model="small",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert answer.usage is not None and chat["count"] == answer.usage.prompt_tokens
    assert chat["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n: at most 16"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "at most 20"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "needs echo"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "at most 20"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "needs logprobs"),
        ("/tokenize", {"prompt": "x", **CHAT}, "either"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "not served here"),
        ("/detokenize", {"tokens": [1, 10**6]}, "token ids"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_limits_and_bad_fields_get_400(
    worker: ServerProcess, path: str, body: dict[str, Any], reason: str
) -> None:
    status, answer = asyncio.run(_post(worker, path, body))
    assert 400 <= status < 500, answer
    assert reason in answer["error"]["message"]


def test_processed_logprobs_on_a_worker_that_asks_for_them(
    small_model_dir: Path, tmp_path: Path
) -> None:
    args = ("--served-model-name", "small", "--logprobs-mode", "processed_logprobs")
    with running_worker(small_model_dir, tmp_path, *args) as processed:
        body = {"prompt": "a", "max_tokens": 3, "top_k": 2, "logprobs": 3, "seed": 4}
        answer = post(processed, "/v1/completions", body)
    for top in answer["choices"][0]["logprobs"]["top_logprobs"]:
        # top_k 2 leaves two tokens to draw from: the third is cut off.
        assert sorted(top.values())[0] == -9999.0


def post(worker: ServerProcess, path: str, body: dict[str, Any]) -> Any:
    status, answer = asyncio.run(_post(worker, path, body))
    assert status == 200, answer
    return answer


async def _post(worker: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    url = f"{worker.url}{path}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=json.dumps(body)) as response,
    ):
        return response.status, await response.json()
