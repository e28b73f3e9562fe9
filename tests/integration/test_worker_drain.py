"""A worker told to stop (SIGTERM) drains: /ready fails at once, new requests get a
503 the router retries elsewhere, and what is in flight (streams, KV hand-offs)
finishes before the process exits."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

from pdserve.workers.faults import Fault
from pdserve.workers.server.process import ServerProcess
from support.pd import complete, pd_workers, token_ids
from support.waiting import wait_until
from support.worker import metric, running_worker

TOKENS = 6


async def first_chunk_then_rest(
    session: aiohttp.ClientSession, url: str, seen: asyncio.Event
) -> list[dict[str, Any]]:
    """Stream a completion; set `seen` at its first chunk; every chunk, to the end."""
    body = {"prompt": "drain me", "max_tokens": TOKENS, "stream": True, "ignore_eos": True}
    chunks = []
    async with session.post(f"{url}/v1/completions", json=body) as answer:
        assert answer.status == 200
        async for line in answer.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            chunks.append(json.loads(text.removeprefix("data: ")))
            seen.set()
    return chunks


def ready_status(worker: ServerProcess) -> tuple[int, str]:
    async def ask() -> tuple[int, str]:
        async with aiohttp.ClientSession() as session, session.get(f"{worker.url}/ready") as answer:
            return answer.status, (await answer.json())["status"]

    return asyncio.run(ask())


def test_a_stopping_worker_finishes_its_streams_and_takes_no_new_ones(
    small_model_dir: Path, tmp_path: Path
) -> None:
    # Steps crawl while the gate exists: the streams are surely in flight when the
    # worker is told to stop, however fast the machine.
    gate = tmp_path / "slow"
    gate.touch()
    faults = {"engine.step": Fault(delay_s=0.5, when=str(gate))}
    with running_worker(small_model_dir, tmp_path, faults=faults) as worker:

        async def scenario() -> tuple[list[list[dict[str, Any]]], int, dict[str, Any]]:
            async with aiohttp.ClientSession() as session:
                started = [asyncio.Event() for _ in range(3)]
                streams = [
                    asyncio.ensure_future(first_chunk_then_rest(session, worker.url, seen))
                    for seen in started
                ]
                await asyncio.gather(*(seen.wait() for seen in started))
                worker.process.send_signal(signal.SIGTERM)
                while (await asyncio.to_thread(ready_status, worker)) != (503, "draining"):
                    await asyncio.sleep(0.05)
                body = {"prompt": "too late", "max_tokens": 2}
                async with session.post(f"{worker.url}/v1/completions", json=body) as late:
                    refused, error = late.status, (await late.json())["error"]
                gate.unlink()
                return list(await asyncio.gather(*streams)), refused, error

        streams, refused, error = asyncio.run(scenario())
        assert refused == 503 and error["code"] == "shutting_down"
        for chunks in streams:
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert not any("error" in c for c in chunks)
        assert worker.process.wait(timeout=30) == 0
        assert "drained" in worker.log()


def test_a_stopping_prefill_worker_completes_its_handoff(
    small_model_dir: Path, tmp_path: Path
) -> None:
    prompt = torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    # The prefill worker holds the computed prompt for 3 s before it writes the blocks.
    faults = {"prefill.before_write": Fault(delay_s=3.0)}
    with pd_workers(small_model_dir, tmp_path, "nixl", prefill_faults=faults) as workers:
        decode, prefill = workers.decode[0], workers.prefill[0]

        async def scenario() -> tuple[int, dict[str, Any]]:
            async with aiohttp.ClientSession() as session:
                call = asyncio.ensure_future(complete(session, decode.url, prompt, prefill.url))
                while metric(prefill, "pdserve_kv_cache_usage_ratio") == 0:
                    await asyncio.sleep(0.05)
                prefill.process.send_signal(signal.SIGTERM)
                return await call

        started = time.monotonic()
        status, answer = asyncio.run(scenario())
        assert status == 200 and len(token_ids(answer)) == 8
        assert metric(decode, "pdserve_kv_transfer_failures_total") == 0
        assert metric(decode, "pdserve_kv_transfer_duration_seconds_count") == 1
        assert prefill.process.wait(timeout=30) == 0
        assert time.monotonic() - started >= 3.0  # it waited for the hand-off
        wait_until(lambda: "drained" in prefill.log(), 5, "the prefill worker's drain")
