"""Prefill and decode workers for hand-off tests, and a client that speaks to them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.workers.handoff.protocol import PREFILL_URL_HEADER
from pdserve.workers.process import WorkerProcess, start_worker


@dataclass
class PDPair:
    """Prefill workers and decode workers of one backend."""

    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]


@contextmanager
def pd_workers(
    model_dir: Path,
    log_dir: Path,
    backend: str,
    prefills: int = 1,
    decodes: int = 1,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
) -> Iterator[PDPair]:
    """Start prefill and decode workers (one torch thread each) on loopback, all at
    once, and stop them all at the end."""
    common = ["--threads", "1", "--kv-transfer", backend, "--served-model-name", "small"]
    started = PDPair([], [])
    try:
        for role, count, extra, into in (
            ("prefill", prefills, prefill_args, started.prefill),
            ("decode", decodes, decode_args, started.decode),
        ):
            for index in range(count):
                log = log_dir / f"{backend}-{role}-{index}.log"
                into.append(start_worker(model_dir, log, [*common, "--role", role, *extra]))
        for worker in started.prefill + started.decode:
            worker.wait_ready()
        yield started
    finally:
        for worker in started.prefill + started.decode:
            worker.stop()


async def complete(
    session: aiohttp.ClientSession,
    decode_url: str,
    prompt: Sequence[int],
    prefill_url: str | None,
    max_tokens: int = 8,
    **extra: Any,
) -> tuple[int, dict[str, Any]]:
    """POST a greedy completion to a decode worker, naming the prefill worker."""
    headers = {PREFILL_URL_HEADER: prefill_url} if prefill_url else {}
    body = {
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    async with session.post(f"{decode_url}/v1/completions", json=body, headers=headers) as answer:
        return answer.status, await answer.json()


def token_ids(answer: dict[str, Any]) -> list[int]:
    """The generated token ids of a completion answer."""
    ids: list[int] = answer["choices"][0]["token_ids"]
    return ids


def run(coroutine: Any) -> Any:
    """Run a coroutine to completion from a synchronous test."""
    return asyncio.run(coroutine)
