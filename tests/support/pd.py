"""Prefill and decode workers for hand-off tests, and a client that speaks to them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.workers import faults
from pdserve.workers.faults import Fault, environment
from pdserve.workers.handoff.protocol import PREFILL_URL_HEADER
from pdserve.workers.server.process import ServerProcess, start_worker


@dataclass
class PDPair:
    """Prefill workers and decode workers of one backend."""

    prefill: list[ServerProcess]
    decode: list[ServerProcess]


@contextmanager
def pd_workers(
    model_dir: Path,
    log_dir: Path,
    backend: str,
    prefills: int = 1,
    decodes: int = 1,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    prefill_faults: dict[str, Fault] | None = None,
    decode_env: dict[str, str] | None = None,
) -> Iterator[PDPair]:
    """Start prefill and decode workers (one torch thread each) on loopback, all at
    once, and stop them all at the end. `prefill_faults` are injected into the
    prefill workers (see `pdserve.workers.faults`); `decode_env` is added to the
    decode workers' environment."""
    common = ["--threads", "1", "--kv-transfer", backend, "--served-model-name", "small"]
    started = PDPair([], [])
    try:
        prefill_env = environment(prefill_faults) if prefill_faults else None
        for role, count, extra, env, into in (
            ("prefill", prefills, prefill_args, prefill_env, started.prefill),
            ("decode", decodes, decode_args, decode_env, started.decode),
        ):
            for index in range(count):
                log = log_dir / f"{backend}-{role}-{index}.log"
                args = [*common, "--role", role, *extra]
                into.append(start_worker(model_dir, log, args, env=env))
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


@dataclass(frozen=True)
class Resources:
    """What a process holds that a leak would grow."""

    threads: int
    open_files: int


def resources(worker: ServerProcess) -> Resources:
    """The threads and open file descriptors of a worker process (Linux /proc)."""
    proc = Path("/proc") / str(worker.process.pid)
    return Resources(len(list((proc / "task").iterdir())), len(list((proc / "fd").iterdir())))


async def wait_for_log(
    worker: ServerProcess, text: str, count: int = 1, timeout_s: float = 60
) -> None:
    """Wait until `text` appears `count` times in a worker's log (e.g. a fault that
    fired: the race it sets up is on)."""
    deadline = time.monotonic() + timeout_s
    while worker.log().count(text) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} not {count} times in the log:\n{worker.log()}")
        await asyncio.sleep(0.02)


def fault_fired(point: str) -> str:
    """The log line a fault point writes when it fires."""
    return (faults.MESSAGE % (point, "")).rstrip()
