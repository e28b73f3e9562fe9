"""n, log-probabilities and scoring across a prefill/decode hand-off: the prompt's KV
moves once and the decode worker forks it into the choices; the first tokens' and the
prompt's log-probabilities come from the prefill worker, checked by the decode
worker, and equal what a colocated engine (and transformers) computes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch

from pdserve.protocol.headers import PREFILL_URL_HEADER
from pdserve.protocol.sampling import SamplingParams
from support.engine import choice_tokens, make_engine, run_outputs
from support.pd import PDPair, internal_headers, pd_workers
from support.scoring import LOGPROB_ATOL, reference_logprobs, reference_model
from support.worker import metric

N = 4
TRANSFERS = "pdserve_kv_transfer_duration_seconds_count"


@pytest.fixture(scope="module")
def pair(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    logs = tmp_path_factory.mktemp("pd-choices")
    budget = ["--max-num-batched-tokens", "64"]
    with pd_workers(small_model_dir, logs, "nixl", prefill_args=budget) as workers:
        yield workers


def prompt_ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


async def handed_off(pair: PDPair, body: dict[str, Any]) -> dict[str, Any]:
    decode_url = pair.decode[0].url
    headers = {PREFILL_URL_HEADER: pair.prefill[0].url, **internal_headers(decode_url)}
    url = f"{decode_url}/v1/completions"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as answer,
    ):
        payload: dict[str, Any] = await answer.json()
        assert answer.status == 200, payload
        return payload


def test_n_choices_from_one_transfer(pair: PDPair, small_model_dir: Path) -> None:
    decode, prefill = pair.decode[0], pair.prefill[0]
    prompt = prompt_ids(1, 90)  # 6 blocks, the last one partial
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=30, ignore_eos=True)
    engine = make_engine(small_model_dir)
    outputs, _ = run_outputs(engine, {"n": (prompt, replace(params, n=N))})
    expected = choice_tokens(outputs["n"], N)
    assert len({tuple(tokens) for tokens in expected}) > 1
    transfers = metric(decode, TRANSFERS), metric(prefill, TRANSFERS)
    allocated = metric(decode, "pdserve_kv_blocks_allocated_total")
    body = {"prompt": prompt, "max_tokens": 8, "seed": 30, "n": N, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    answer = asyncio.run(handed_off(pair, body))
    assert [choice["token_ids"] for choice in answer["choices"]] == expected
    # One transfer; on the decode worker the prompt's 6 blocks were reserved once,
    # then a copy of the partial one for 3 choices, and each choice's 7th block (the
    # KV of its tokens from position 96 on).
    assert (metric(decode, TRANSFERS), metric(prefill, TRANSFERS)) == (
        transfers[0] + 1, transfers[1] + 1,
    )  # fmt: skip
    assert metric(decode, "pdserve_kv_blocks_allocated_total") - allocated == 6 + (N - 1) + N
    assert metric(decode, "pdserve_kv_transfer_failures_total") == 0
    assert metric(decode, "pdserve_kv_cache_usage_ratio") == 0.0


def test_scoring_a_prompt_across_the_hand_off(pair: PDPair, small_model_dir: Path) -> None:
    prompt = prompt_ids(2, 120)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    answer = asyncio.run(handed_off(pair, body))
    values = answer["choices"][0]["logprobs"]["token_logprobs"]
    expected = reference_logprobs(reference_model(small_model_dir), prompt)
    assert values[0] is None and len(values) == len(prompt)
    for position in range(1, len(prompt)):
        assert abs(values[position] - expected[position - 1, prompt[position]].item()) < (
            LOGPROB_ATOL
        )
    assert answer["usage"]["completion_tokens"] == 0


def test_first_token_logprobs_come_from_the_prefill_worker(
    pair: PDPair, small_model_dir: Path
) -> None:
    prompt = prompt_ids(3, 70)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs, _ = run_outputs(make_engine(small_model_dir), {"g": (prompt, params)})
    expected = [entry for output in outputs["g"] for entry in output.logprobs or ()]
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3,
            "ignore_eos": True}  # fmt: skip
    answer = asyncio.run(handed_off(pair, body))
    values = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert len(values) == len(expected) == 5
    for value, entry in zip(values, expected, strict=True):
        assert abs(value - entry.logprob) < LOGPROB_ATOL


def test_streamed_chat_choices_parse_across_the_hand_off(pair: PDPair) -> None:
    client = openai.OpenAI(
        base_url=f"{pair.decode[0].url}/v1", api_key="unused", max_retries=0,
        default_headers={
            PREFILL_URL_HEADER: pair.prefill[0].url, **internal_headers(pair.decode[0].url)
        },
    )  # fmt: skip
    stream = client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "hello"}], max_tokens=4, n=2,
        seed=8, logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    entries = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            assert choice.logprobs is not None and choice.logprobs.content is not None
            entries[choice.index] += len(choice.logprobs.content)
    assert entries == {0: 4, 1: 4}
    assert metric(pair.decode[0], "pdserve_requests_total", finish_reason="length") > 0
