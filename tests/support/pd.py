"""Prefill and decode workers for hand-off tests, and a client that speaks to them.

Workers started here belong to a pool of their own: they share an internal
credential (made per pool), decode workers name the pool's prefill workers as their
peers, and `complete` and `internal_headers` present the credential of the pool a
worker belongs to, as the router does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.base.credentials import write_new_credential
from pdserve.protocol.headers import PREFILL_URL_HEADER
from pdserve.protocol.internal import bearer
from pdserve.workers import faults
from pdserve.workers.faults import Fault, environment
from pdserve.workers.server.process import ServerProcess, start_worker

# The credential of the pool each worker started here belongs to, by its URL.
_CREDENTIALS: dict[str, str] = {}


def pool_credential(log_dir: Path, name: str = "pool") -> tuple[str, list[str]]:
    """A new pool credential and the worker arguments that hold it."""
    path = log_dir / f"{name}.credential"
    return write_new_credential(path), ["--internal-token-file", str(path)]


def peers_file(log_dir: Path, name: str = "pool") -> tuple[Path, list[str]]:
    """Where a pool's decode workers find its prefill workers, and the arguments that
    say so (the file is written once the prefill workers have bound their ports, so
    all workers start at once)."""
    path = log_dir / f"{name}.prefill-peers"
    path.unlink(missing_ok=True)
    return path, ["--prefill-peers-file", str(path)]


def name_peers(path: Path, prefills: Sequence[ServerProcess]) -> None:
    """Write the prefill workers' URLs (waiting until they listen) for the decode workers."""
    path.write_text("".join(f"{worker.url}\n" for worker in prefills))


def join_pool(credential: str, *workers: ServerProcess) -> None:
    """Remember that `workers` hold `credential` (for `complete`, `internal_headers`)."""
    for worker in workers:
        _CREDENTIALS[worker.url] = credential


def internal_headers(worker_url: str) -> dict[str, str]:
    """The header that presents the credential of the pool `worker_url` belongs to."""
    credential = _CREDENTIALS.get(worker_url)
    return bearer(credential) if credential else {}


@dataclass
class PDPair:
    """Prefill workers and decode workers of one backend."""

    prefill: list[ServerProcess]
    decode: list[ServerProcess]
    peers: Path | None = None  # the decode workers' prefill peers file


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
    once, with a pool credential, the decode workers naming the prefill workers as
    their peers; stop them all at the end. `prefill_faults` are injected into the
    prefill workers (see `pdserve.workers.faults`); `decode_env` is added to the
    decode workers' environment."""
    credential, holds = pool_credential(log_dir, f"{backend}-pool")
    peers, names = peers_file(log_dir, f"{backend}-pool")
    common = ["--threads", "1", "--kv-transfer", backend, "--served-model-name", "small", *holds]
    started = PDPair([], [], peers)
    try:
        prefill_env = environment(prefill_faults) if prefill_faults else None
        for role, count, extra, env, into in (
            ("prefill", prefills, prefill_args, prefill_env, started.prefill),
            ("decode", decodes, [*names, *decode_args], decode_env, started.decode),
        ):
            for index in range(count):
                log = log_dir / f"{backend}-{role}-{index}.log"
                args = [*common, "--role", role, *extra]
                into.append(start_worker(model_dir, log, args, env=env))
        name_peers(peers, started.prefill)
        for worker in started.prefill + started.decode:
            worker.wait_ready()
        join_pool(credential, *started.prefill, *started.decode)
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
    extra_headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> tuple[int, dict[str, Any]]:
    """POST a greedy completion to a decode worker, naming the prefill worker (if
    any), with the pool's credential (and `extra_headers`), as the router sends it."""
    headers = {**internal_headers(decode_url), **(extra_headers or {})}
    if prefill_url:
        headers[PREFILL_URL_HEADER] = prefill_url
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
