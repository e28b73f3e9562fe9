"""Pools for router tests: a ServingPool run by the local backend (the command lines
the operator renders), standalone routers, and reading what they report."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from pdserve.base.process import ServerProcess, start_server
from pdserve.operator import api
from pdserve.operator.local.pool import LocalPool
from pdserve.protocol.internal import bearer
from support.prom import total


class HasUrl(Protocol):
    """Something serving at a URL (a router process, a local pool)."""

    @property
    def url(self) -> str: ...


# A small CPU pool for the tests' small model: prompts of up to BOUNDARY tokens are
# served colocated, longer ones disaggregated (routing by load, not by cached prefix).
BOUNDARY = 64


def pool_manifest(name: str, model_dir: Path, **spec: Any) -> api.ServingPool:
    """A ServingPool on the small model; `spec` replaces top-level spec fields."""
    engine = {"maxNumBatchedTokens": 64, "maxNumSeqs": 16, "numKvBlocks": 256}
    base: dict[str, Any] = {
        "model": {"name": "small", "path": str(model_dir), "dtype": "float32", "maxModelLen": 1024},
        "image": "pdserve:test",
        "prefill": {"replicas": 1, "engine": engine},
        "decode": {"replicas": 1, "engine": engine},
        "kvTransfer": {"backend": "nixl", "failurePolicy": "recompute"},
        "routing": {
            # By length and load: these pools test the buckets, which KV-aware routing
            # would bend for prompts a worker holds (see test_kv_routing).
            "policy": "load",
            "buckets": [
                {"maxInputTokens": BOUNDARY, "mode": "colocated"},
                {"mode": "disaggregated"},
            ],
        },
        "slo": {"ttft": {"seconds": 5.0}, "itl": {"seconds": 1.0}},
    }
    base.update(spec)
    return api.parse_pool(
        {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": base}
    )


@contextmanager
def local_pool(
    pool: api.ServingPool,
    run_dir: Path,
    env: Mapping[str, Mapping[str, str]] | None = None,
    api_key_file: Path | None = None,
) -> Iterator[LocalPool]:
    """The pool's router and workers, started as `pdserve local` starts them."""
    with LocalPool(pool, run_dir, env=env, api_key_file=api_key_file) as started:
        yield started


@contextmanager
def running_router(routing_file: Path, log_path: Path, *args: str) -> Iterator[ServerProcess]:
    """A standalone `pdserve router` on a routing file (not waited for)."""
    router = start_server("router", log_path, ["--config", str(routing_file), *args])
    try:
        yield router
    finally:
        router.stop()


def static_routing_file(folder: Path, model_dir: Path, decode_url: str, pool: str) -> Path:
    """A routing table sending every prompt to one decode worker, colocated."""
    table = {
        "pool": pool,
        "model": {"name": "small", "path": str(model_dir)},
        "buckets": [{"mode": "colocated"}],
        "discovery": {"kind": "static", "decode": [decode_url]},
    }
    path = folder / "routing.json"
    path.write_text(json.dumps(table))
    return path


def as_router(pool: LocalPool) -> dict[str, str]:
    """The header with which the pool's router calls its workers (their OpenAI
    endpoints serve nobody else)."""
    return bearer(pool.credential_file.read_text().strip())


def router_metric(router: HasUrl, name: str, **labels: str) -> float:
    """The sum of a router metric's samples that carry `labels`."""
    return total(f"{router.url}/metrics", name, **labels)


def known_workers(router_url: str) -> dict[str, list[dict[str, Any]]]:
    """The router's /workers: what discovery found and each worker's state."""
    with urllib.request.urlopen(f"{router_url}/workers", timeout=5) as answer:
        found: dict[str, list[dict[str, Any]]] = json.load(answer)
    return found


def worker_load(worker_url: str) -> dict[str, Any]:
    """A worker's /load."""
    with urllib.request.urlopen(f"{worker_url}/load", timeout=5) as answer:
        load: dict[str, Any] = json.load(answer)
    return load


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int) -> Any:
    """A streamed greedy completion: (status, token ids, the error event or None)."""
    body = {
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            return response.status, [], await response.text()
        return (response.status, *await read_events(response))


async def read_events(response: aiohttp.ClientResponse) -> tuple[list[int], Any]:
    """The token ids a stream carries, and its error event (None if it ended well)."""
    ids: list[int] = []
    async for line in response.content:
        data = line.strip().removeprefix(b"data:").strip()
        if not data or data == b"[DONE]":
            continue
        event = json.loads(data)
        if "error" in event:
            return ids, event["error"]
        ids += event["choices"][0].get("token_ids", [])
    return ids, None
