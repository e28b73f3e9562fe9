"""Admission control and engine death, on a real worker: a bounded queue (429 with
Retry-After past it), a deadline in the queue (503), and an engine that dies answers
everything it holds with 503 at once.

Each test keeps the worker's single seat (`--max-num-seqs 1`) busy with one long
streaming request, on an engine whose every step is slowed by an injected stall, so
the queue fills the same way on any machine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.workers.faults import Fault
from support.waiting import wait_until
from support.worker import metric, running_worker

SLOW_STEPS = Fault(delay_s=0.05)
ONE_SEAT = ("--max-num-seqs", "1")


async def complete(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any], Any]:
    body = {"prompt": "hello there", "max_tokens": 2, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as answer:
        return answer.status, dict(answer.headers), await answer.json()


@asynccontextmanager
async def seat_taken(session: aiohttp.ClientSession, url: str) -> AsyncIterator[None]:
    """A long streaming request holds the only seat (its first token has arrived)
    until the block ends, when it disconnects."""
    body = {"prompt": "hold the seat", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as answer:
        assert answer.status == 200
        await answer.content.readline()
        yield


def test_past_the_queue_cap_requests_get_429_and_the_admitted_finish(
    small_model_dir: Path, tmp_path: Path
) -> None:
    args = (*ONE_SEAT, "--max-queued-requests", "4")
    with running_worker(small_model_dir, tmp_path, *args, faults={"engine.step": SLOW_STEPS}) as w:

        async def run() -> tuple[list[int], list[tuple[int, dict[str, Any], Any]]]:
            async with aiohttp.ClientSession() as session:
                async with seat_taken(session, w.url):
                    calls = [asyncio.ensure_future(complete(session, w.url)) for _ in range(10)]
                    # While the seat is taken nothing admitted can finish: what comes
                    # back now is what was refused.
                    early = []
                    for call in asyncio.as_completed(calls):
                        early.append((await call)[0])
                        if len(early) == 6:
                            break
                # The long request is gone: the admitted ones get the seat in turn.
                return early, list(await asyncio.gather(*calls))

        early, answers = asyncio.run(run())
        assert early == [429] * 6
        statuses = sorted(status for status, _, _ in answers)
        assert statuses == [200] * 4 + [429] * 6
        for status, headers, body in answers:
            if status == 429:
                assert headers["Retry-After"] == "1"
                assert body["error"]["code"] == "queue_full"
        assert metric(w, "pdserve_requests_rejected_total", reason="queue_full") == 6


def test_a_request_that_waits_past_the_queue_deadline_gets_503(
    small_model_dir: Path, tmp_path: Path
) -> None:
    args = (*ONE_SEAT, "--queue-timeout", "0.5")
    with running_worker(small_model_dir, tmp_path, *args, faults={"engine.step": SLOW_STEPS}) as w:

        async def run() -> tuple[int, dict[str, Any], Any]:
            async with aiohttp.ClientSession() as session, seat_taken(session, w.url):
                return await complete(session, w.url)

        status, _, body = asyncio.run(run())
        assert status == 503 and body["error"]["code"] == "queue_timeout"
        assert metric(w, "pdserve_requests_rejected_total", reason="queue_timeout") == 1
        wait_until(lambda: metric(w, "pdserve_requests_waiting") == 0, 30, "an empty queue")


def test_an_engine_crash_answers_every_queued_request_with_503(
    small_model_dir: Path, tmp_path: Path
) -> None:
    crash = tmp_path / "crash-now"
    faults = {"engine.step": [SLOW_STEPS, Fault(error="injected crash", when=str(crash))]}
    with running_worker(small_model_dir, tmp_path, *ONE_SEAT, faults=faults) as w:

        async def run() -> tuple[list[int], list[Any], float]:
            # No connection limit: all 101 requests are open at once.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                body = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with session.post(f"{w.url}/v1/completions", json=body) as streaming:
                    await streaming.content.readline()
                    calls = [asyncio.ensure_future(complete(session, w.url)) for _ in range(100)]
                    await asyncio.to_thread(
                        wait_until,
                        lambda: metric(w, "pdserve_requests_waiting") == 100,
                        120,
                        "100 queued requests",
                    )
                    crash.touch()
                    struck = time.monotonic()
                    answers = await asyncio.gather(*calls)
                    took = time.monotonic() - struck
                    tail = [json.loads(line[6:]) async for line in _data(streaming)]
            return [status for status, _, _ in answers], tail, took

        statuses, tail, took = asyncio.run(run())
        assert statuses == [503] * 100
        assert any("error" in event for event in tail)  # the stream ends with an error event
        assert took < 5, f"the queued requests were answered {took:.2f}s after the crash"
        print(f"100 queued requests answered 503 within {took * 1000:.0f} ms of the crash")
        assert asyncio.run(_status(f"{w.url}/health")) == 503
        assert asyncio.run(_status(f"{w.url}/ready")) == 503


async def _data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield line


async def _status(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        return answer.status
