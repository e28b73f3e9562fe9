"""A real `pdserve worker` process, driven through the `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.model.tokenizer import Tokenizer
from support.engine import make_engine, run_to_completion
from support.worker import ServerProcess, metric, running_worker

MAX_MODEL_LEN = 1024
KV_BLOCKS = 48  # 768 tokens of KV cache: less than the context, so both limits can be hit


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(KV_BLOCKS),
            "--max-num-batched-tokens", "64", "--served-model-name", "small")  # fmt: skip
    with running_worker(small_model_dir, tmp_path_factory.mktemp("logs"), *args) as process:
        yield process


@pytest.fixture(scope="module")
def client(worker: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == ["small"]


def test_completion_matches_the_engine(client: openai.OpenAI, small_model_dir: Path) -> None:
    prompt = list(range(10, 90))
    result = client.completions.create(
        model="small",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    expected, _ = run_to_completion(
        make_engine(small_model_dir),
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    tokenizer = Tokenizer.from_dir(small_model_dir)
    assert (result.choices[0].model_extra or {})["token_ids"] == expected[0]
    assert result.choices[0].text == tokenizer.decode(expected[0])
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (80, 12)


def test_streaming_completion_sends_a_chunk_per_token(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="small", prompt="Hello there", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 10
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    whole = client.completions.create(
        model="small", prompt="Hello there", max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text


def test_chat_completion_streaming_and_not(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model="small", messages=messages, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="small", messages=messages, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model="small", prompt=list(range(5, 40)), max_tokens=20, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the generated text is too short to pick a stop string"
    cut = client.completions.create(
        model="small", prompt=list(range(5, 40)), max_tokens=20, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": [5] * (MAX_MODEL_LEN + 4), "max_tokens": 4}, "maximum context length"),
        ({"prompt": list(range(1, 700)), "max_tokens": 200}, "KV cache"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "n": 17}, "n: at most 16"),
        ({"prompt": "hi", "logprobs": 21}, "at most 20 alternatives"),
        ({"prompt": "hi", "echo": True, "logprobs": 21, "max_tokens": 0}, "at most 20"),
        ({"prompt": [1, 2, 99999]}, "token ids"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "model": "other"}, "not served here"),
    ],
)
def test_bad_requests_get_4xx_with_a_reason(
    worker: ServerProcess, body: dict[str, object], reason: str
) -> None:
    status, answer = asyncio.run(post(worker.url, "/v1/completions", json.dumps(body).encode()))
    assert 400 <= status < 500
    assert reason in answer["error"]["message"]


def test_malformed_json_gets_400(worker: ServerProcess) -> None:
    status, answer = asyncio.run(post(worker.url, "/v1/completions", b'{"prompt": "unterminated'))
    assert status == 400 and "malformed JSON" in answer["error"]["message"]


def test_rejected_requests_leave_nothing_behind(
    worker: ServerProcess, client: openai.OpenAI
) -> None:
    asyncio.run(
        post(
            worker.url,
            "/v1/completions",
            json.dumps({"prompt": list(range(1, 700)), "max_tokens": 200}).encode(),
        )
    )
    assert metric(worker, "pdserve_kv_cache_usage_ratio") == 0.0
    ok = client.completions.create(model="small", prompt="still serving", max_tokens=2)
    assert ok.choices[0].text is not None


def test_client_disconnect_aborts_the_request(worker: ServerProcess) -> None:
    aborted_before = metric(worker, "pdserve_requests_total", finish_reason="abort")

    async def read_a_little_then_leave() -> None:
        body = {
            "prompt": list(range(1, 400)),
            "max_tokens": 300,
            "stream": True,
            "ignore_eos": True,
        }
        url = f"{worker.url}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            for _ in range(3):
                await response.content.readline()

    asyncio.run(read_a_little_then_leave())

    def settled() -> bool:
        aborted = metric(worker, "pdserve_requests_total", finish_reason="abort")
        idle = metric(worker, "pdserve_requests_running") == 0.0
        return aborted > aborted_before and idle and kv_usage(worker) == 0.0

    deadline = time.monotonic() + 10
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(worker, "pdserve_requests_total", finish_reason="abort") == aborted_before + 1
    assert metric(worker, "pdserve_requests_running") == 0.0
    assert kv_usage(worker) == 0.0


def kv_usage(worker: ServerProcess) -> float:
    return metric(worker, "pdserve_kv_cache_usage_ratio")


def test_metrics_count_what_was_served(worker: ServerProcess, client: openai.OpenAI) -> None:
    before = metric(worker, "pdserve_time_to_first_token_seconds_count")
    client.completions.create(
        model="small", prompt="count me", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert metric(worker, "pdserve_time_to_first_token_seconds_count") == before + 1
    assert metric(worker, "pdserve_inter_token_latency_seconds_count") >= 2
    assert metric(worker, "pdserve_engine_step_tokens_count") > 0
    # The dashboard draws tokens per step against the budget they fill.
    steps = metric(worker, "pdserve_engine_token_budget_count")
    assert steps > 0 and metric(worker, "pdserve_engine_token_budget_sum") == 64 * steps


async def post(url: str, path: str, data: bytes) -> tuple[int, dict[str, dict[str, str]]]:
    async with aiohttp.ClientSession() as session:
        headers = {"Content-Type": "application/json"}
        async with session.post(url + path, data=data, headers=headers) as response:
            return response.status, await response.json()
