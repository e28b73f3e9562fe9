"""One request never stops an engine: a real worker whose building of a step, model
forward pass, sampler or detokenizer raises for one chosen request (a fault aimed at
that request's X-Request-Id) fails that request alone. The other requests in flight
with it complete with the tokens they get without the fault, the worker stays
healthy, and the failed request's KV blocks are freed.

Every step stalls while a gate file exists, so all requests are admitted before the
aimed one arrives and its fault strikes in a batch the others share, on any machine."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.workers.faults import Fault
from support.waiting import wait_until
from support.worker import ServerProcess, metric, running_worker

POINTS = ("engine.prepare", "engine.forward", "engine.sample", "server.detokenize")
OTHERS = 19
MAX_TOKENS = 24


def aimed_at(point: str) -> str:
    """The X-Request-Id of the request a point's fault is aimed at."""
    return f"poison-{point}"


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate") / "steps-stall"


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, gate: Path
) -> Iterator[ServerProcess]:
    faults: dict[str, Fault | list[Fault]] = {
        point: Fault(error=f"injected at {point}", request=aimed_at(point)) for point in POINTS
    }
    faults["engine.step"] = Fault(delay_s=0.2, when=str(gate))
    args = ("--max-num-seqs", "32", "--max-num-batched-tokens", "1024")
    with running_worker(
        small_model_dir, tmp_path_factory.mktemp("logs"), *args, faults=faults
    ) as process:
        yield process


def body(index: int, stream: bool) -> dict[str, Any]:
    """A greedy request of its own prompt, for `MAX_TOKENS` tokens."""
    return {
        "prompt": f"request number {index} says",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


async def send(
    session: aiohttp.ClientSession, url: str, index: int, request_id: str, stream: bool
) -> tuple[int, list[int], dict[str, Any] | None]:
    """(status, generated token ids, the error: the body's or the stream's event)."""
    headers = {"X-Request-Id": request_id}
    async with session.post(
        f"{url}/v1/completions", json=body(index, stream), headers=headers
    ) as answer:
        if answer.status != 200:
            return answer.status, [], (await answer.json())["error"]
        if not stream:
            return answer.status, (await answer.json())["choices"][0]["token_ids"], None
        tokens: list[int] = []
        error = None
        async for line in answer.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[6:])
            if "error" in event:
                error = event["error"]
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
        return answer.status, tokens, error


def in_engine(worker: ServerProcess) -> float:
    return metric(worker, "pdserve_requests_running") + metric(worker, "pdserve_requests_waiting")


def run_batch(
    worker: ServerProcess, gate: Path, aimed: str | None, stream: bool
) -> list[tuple[int, list[int], dict[str, Any] | None]]:
    """OTHERS requests admitted while steps stall; then, if `aimed`, the request the
    faults are aimed at, which fails in its first step while the others are still in
    flight (checked); then the gate opens. Answers in order, the aimed request's last."""

    async def run() -> list[tuple[int, list[int], dict[str, Any] | None]]:
        async with aiohttp.ClientSession() as session:
            calls = [
                asyncio.ensure_future(send(session, worker.url, i, f"other-{i}", stream))
                for i in range(OTHERS)
            ]
            await asyncio.to_thread(wait_until, lambda: in_engine(worker) == OTHERS, 120, "all in")
            if aimed is not None:
                calls.append(asyncio.ensure_future(send(session, worker.url, -1, aimed, stream)))
                await calls[-1]
                # The others are all still in flight (the aimed one's abort is seen
                # at the next step).
                in_flight = lambda: in_engine(worker) == OTHERS  # noqa: E731
                await asyncio.to_thread(wait_until, in_flight, 120, "the others in flight")
                assert not any(call.done() for call in calls[:-1])
            gate.unlink()
            return list(await asyncio.gather(*calls))

    gate.touch()
    return asyncio.run(run())


def healthy(worker: ServerProcess) -> bool:
    with urllib.request.urlopen(f"{worker.url}/health", timeout=10) as answer:
        status: int = answer.status
        return status == 200


@pytest.fixture(scope="module")
def expected(worker: ServerProcess, gate: Path) -> list[list[int]]:
    """The tokens each of the other requests gets with no fault in its batch."""
    answers = run_batch(worker, gate, None, stream=False)
    assert all(status == 200 for status, _, _ in answers)
    return [tokens for _, tokens, _ in answers]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("point", POINTS)
def test_a_fault_in_one_request_fails_it_alone(
    worker: ServerProcess, gate: Path, expected: list[list[int]], point: str, stream: bool
) -> None:
    failed_before = metric(worker, "pdserve_requests_total", finish_reason="error")
    answers = run_batch(worker, gate, aimed_at(point), stream)
    *others, (status, _, error) = answers
    assert [tokens for _, tokens, _ in others] == expected
    assert all(status == 200 and error is None for status, _, error in others)
    # The aimed request gets a server error that names its failure: an error status
    # when it fails before its first token (in the engine), an error event when its
    # stream had begun (the detokenizer fails on the first token's text).
    assert status == (200 if stream and point == "server.detokenize" else 500)
    assert error is not None and error["code"] == "request_failed"
    assert f"injected at {point}" in error["message"]
    assert healthy(worker)
    wait_until(lambda: metric(worker, "pdserve_kv_cache_usage_ratio") == 0.0, 60, "an empty cache")
    assert metric(worker, "pdserve_requests_total", finish_reason="error") == failed_before + 1
    # And the engine goes on serving as before.
    again = run_batch(worker, gate, None, stream=False)
    assert [tokens for _, tokens, _ in again] == expected
