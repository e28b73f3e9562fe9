"""What the router adds: latency per request (P50, P99) and the most requests/s, through
the router against straight to the upstream, in the same run. Two upstreams: a worker
on the tiny model (what a user sees), and the scripted fake server, which answers at
once (the router's own ceiling). Requests to both paths alternate, so drifts in the
machine's load hit both alike. Run with `make bench`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from pdserve.operator import api, render
from support.fake_server import fake_server
from support.results import publish
from support.router import local_pool, running_router

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SEQUENTIAL = 300  # requests per path, one at a time
CONCURRENCY = 16
LOAD_SECONDS = 15.0
BODY = {"prompt": list(range(10, 26)), "max_tokens": 4, "ignore_eos": True, "stream": True}


async def one(session: aiohttp.ClientSession, url: str) -> float:
    """Seconds from sending a streamed completion to its [DONE]."""
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=BODY) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.strip() == b"data: [DONE]":
                return time.perf_counter() - started
    raise AssertionError("the stream ended without [DONE]")


async def latencies(urls: dict[str, str]) -> dict[str, list[float]]:
    """One request at a time, alternating between the paths."""
    seen: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession() as session:
        for url in urls.values():  # warm both paths' connections
            await one(session, url)
        for _ in range(SEQUENTIAL):
            for name, url in urls.items():
                seen[name].append(await one(session, url))
    return seen


async def most_requests_per_second(url: str) -> float:
    """Completed requests/s with CONCURRENCY clients sending back to back."""
    done = 0
    deadline = time.perf_counter() + LOAD_SECONDS

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await one(session, url)
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(CONCURRENCY)))
        return done / (time.perf_counter() - started)


def measure(upstream: str, direct: str, routed: str) -> list[dict[str, Any]]:
    seen = asyncio.run(latencies({"direct": direct, "router": routed}))
    rates = {"direct": asyncio.run(most_requests_per_second(direct))}
    rates["router"] = asyncio.run(most_requests_per_second(routed))
    rows = []
    for path in ("direct", "router"):
        p50, p99 = np.percentile(seen[path], [50, 99]) * 1000
        rows.append({"upstream": upstream, "path": path, "p50_ms": p50, "p99_ms": p99,
                     "max_req_per_s": rates[path]})  # fmt: skip
    direct_row, router_row = rows
    for row in rows:
        row["added_p50_ms"] = row["p50_ms"] - direct_row["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - direct_row["p99_ms"]
        row["req_per_s_vs_direct"] = row["max_req_per_s"] / direct_row["max_req_per_s"]
    assert router_row["req_per_s_vs_direct"] > 0
    return rows


def colocated_pool(model_dir: Path) -> api.ServingPool:
    spec = {
        "model": {"name": "tiny-llama", "path": str(model_dir), "dtype": "float32"},
        "image": "pdserve:bench",
        "decode": {"replicas": 1, "engine": {"maxNumBatchedTokens": 256, "maxNumSeqs": 32}},
        "routing": {"buckets": [{"mode": "colocated"}]},
        # The worker is measured without the router too, as the baseline.
        "router": {"allowDirectClients": True},
    }
    return api.parse_pool(
        {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "o"}, "spec": spec}
    )


def test_router_overhead(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = []
    pool = colocated_pool(tiny_model_dir)
    with local_pool(pool, tmp_path / "pool") as local:
        rows += measure("tiny worker", local.workers["decode"][0].url, local.url)
    with fake_server() as upstream:
        discovery = {"kind": "static", "decode": [upstream]}
        routing = tmp_path / "routing.json"
        table = render.routing_table("o", "local", pool.spec, discovery)
        routing.write_text(render.routing_json(table))
        with running_router(routing, tmp_path / "router.log") as router:
            router.wait_ready()
            rows += measure("fake server", upstream, router.url)
    publish(
        "router_overhead", rows,
        {"sequential_requests_per_path": SEQUENTIAL, "concurrency": CONCURRENCY,
         "load_seconds": LOAD_SECONDS, "request": "16-token prompt, 4 tokens streamed"},
    )  # fmt: skip
