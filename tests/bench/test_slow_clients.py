"""What slow and non-reading clients cost the router and a worker, at the pool's
default settings: 300 connections that send half their headers to each, then 10
streams nobody reads (16 choices, 4000 tokens and 20 log-probabilities each) through
the router. For each window: the resident memory (VmRSS) of each process at its
start, at its peak and at its end, the connections each holds open at the end (the
kernel's count) and how many it has cut off, and the worker's KV cache usage and
running requests then.

Run with `make bench`. For the figures before a change, run the same file against
the older code: `PYTHONPATH` set to the older checkout's `*/src` folders (base,
protocol, cli, workers, operator) puts its packages first, in this process and the
servers it starts."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pdserve.workers
from pdserve.workers.server.process import ServerProcess
from support.prom import total
from support.results import publish
from support.router import running_router, static_routing_file
from support.slow_clients import (
    REFUSALS,
    close_all,
    rss_bytes,
    send_half_headers,
    start_unread_stream,
)
from support.worker import metric, running_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SLOW_HEADER_CONNECTIONS = 300  # to each server
HEADERS_WINDOW_S = 30.0  # three times the default header timeout
UNREAD_STREAMS = 10
STREAMS_WINDOW_S = 120.0
UNREAD = {
    "prompt": "hello there", "n": 16, "max_tokens": 4000, "logprobs": 20,
    "stream": True, "ignore_eos": True,
}  # fmt: skip
MIB = 1024 * 1024
TCP_ESTABLISHED = "01"  # in /proc/net/tcp


def connections_open(port: int) -> int:
    """Established TCP connections to a local server's port, as the kernel lists
    them: what the server holds open, whatever its clients' sides think."""
    established = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state = line.split()[1], line.split()[3]
            if state == TCP_ESTABLISHED and int(local.rsplit(":", 1)[1], 16) == port:
                established += 1
    return established


def watch(
    window: str,
    servers: dict[str, ServerProcess],
    duration_s: float,
    socks: dict[str, list[socket.socket]],
) -> list[dict[str, Any]]:
    """Sample the servers' memory once a second for `duration_s`; one row each, with
    the connections it holds open at the end and how many it cut off so far."""
    pids = {name: server.process.pid for name, server in servers.items()}
    samples: dict[str, list[int]] = {name: [] for name in servers}
    ends = time.monotonic() + duration_s
    while True:
        for name, pid in pids.items():
            samples[name].append(rss_bytes(pid))
        if time.monotonic() >= ends:
            break
        time.sleep(1.0)
    worker = servers["worker"]
    rows = []
    for name, values in samples.items():
        rows.append({
            "window": window, "process": name, "rss_start_mib": values[0] / MIB,
            "rss_peak_mib": max(values) / MIB, "rss_end_mib": values[-1] / MIB,
            "growth_mib": (max(values) - values[0]) / MIB,
            "clients": len(socks.get(name, [])),
            "connections_open_end": connections_open(servers[name].port),
            "cut_off": total(f"{servers[name].url}/metrics", REFUSALS),
            "kv_usage_end": metric(worker, "pdserve_kv_cache_usage_ratio"),
            "running_end": metric(worker, "pdserve_requests_running"),
        })  # fmt: skip
    return rows


def under(
    window: str,
    servers: dict[str, ServerProcess],
    duration_s: float,
    clients: Callable[[], dict[str, list[socket.socket]]],
) -> list[dict[str, Any]]:
    """The rows of a window during which `clients` (by the server they connect to) hold
    their connections."""
    socks = clients()
    try:
        return watch(window, servers, duration_s, socks)
    finally:
        for held in socks.values():
            close_all(held)


def test_memory_under_slow_clients(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_worker(tiny_model_dir, tmp_path) as worker:
        routing = static_routing_file(tmp_path, tiny_model_dir, worker.url, "bench")
        with running_router(routing, tmp_path / "router.log") as router:
            router.wait_ready()
            servers = {"router": router, "worker": worker}
            asyncio.run(warm_up(router.url))

            def half_headers() -> dict[str, list[socket.socket]]:
                return {
                    name: [send_half_headers(server.url) for _ in range(SLOW_HEADER_CONNECTIONS)]
                    for name, server in servers.items()
                }

            def unread_streams() -> dict[str, list[socket.socket]]:
                streams = [
                    start_unread_stream(router.url, "/v1/completions", UNREAD)
                    for _ in range(UNREAD_STREAMS)
                ]
                return {"router": streams}

            rows = under("300 slow-header connections", servers, HEADERS_WINDOW_S, half_headers)
            rows += under("10 non-reading streams", servers, STREAMS_WINDOW_S, unread_streams)
    publish(
        "slow_clients", rows,
        {"code": str(list(pdserve.workers.__path__)), "slow_header_connections":
         SLOW_HEADER_CONNECTIONS, "headers_window_s": HEADERS_WINDOW_S,
         "unread_streams": UNREAD_STREAMS, "streams_window_s": STREAMS_WINDOW_S,
         "unread_request": UNREAD},
    )  # fmt: skip


async def warm_up(url: str) -> None:
    """One small request of each kind, so first-use allocations are in the baseline."""
    import aiohttp

    body = {**UNREAD, "n": 2, "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as answer,
    ):
        assert answer.status == 200, await answer.text()
        await answer.read()
