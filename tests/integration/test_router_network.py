"""The router's network limits against clients that cost what they can, on raw sockets
(see test_worker_network for the worker's): half-sent headers and bodies that stop
are cut off within their timeouts, a client that does not read its stream is cut off
and the worker's request ends, and past the caps on open connections and on bodies
being read the excess gets 503 with Retry-After; each refusal counted."""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.protocol.api_errors import APIError, error_response
from pdserve.workers.network.bodies import TOO_MANY_CONNECTIONS
from pdserve.workers.server.process import ServerProcess
from support.network import serving
from support.prom import total
from support.router import known_workers, router_metric, running_router, static_routing_file
from support.slow_clients import (
    HEAVY_STREAM,
    REFUSALS,
    Answer,
    assert_half_headers_cut_off,
    assert_stopped_body_gets_408,
    close_all,
    connect,
    read_answer,
    request_head,
    send_partial_body,
    start_unread_stream,
    wait_unread_stream_ended,
)
from support.worker import running_worker

HEADER_S = 1.0
BODY_S = 1.0
WRITE_S = 1.0
CONNECTIONS = 4
BODY_READS = 2


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The router's worker; no bound on buffered tokens worth the name, so a client
    that stops reading meets the router's write timeout, not the worker's bound."""
    args = ("--max-stream-buffer-tokens", "1000000")
    with running_worker(small_model_dir, tmp_path_factory.mktemp("worker"), *args) as started:
        yield started


@pytest.fixture(scope="module")
def routing(
    worker: ServerProcess, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return static_routing_file(
        tmp_path_factory.mktemp("routing"), small_model_dir, worker.url, "net"
    )


@pytest.fixture(scope="module")
def router(routing: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A router with short timeouts."""
    args = (
        "--timeout-request-headers", str(HEADER_S), "--timeout-request-body", str(BODY_S),
        "--timeout-write", str(WRITE_S),
    )  # fmt: skip
    log = tmp_path_factory.mktemp("router") / "router.log"
    with running_router(routing, log, *args) as started:
        started.wait_ready()
        yield started


@pytest.fixture
def capped(routing: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """A new router with small caps on connections and bodies being read, and a body
    timeout too long to matter."""
    args = (
        "--limit-concurrency", str(CONNECTIONS), "--limit-body-reads", str(BODY_READS),
        "--timeout-request-body", "600",
    )  # fmt: skip
    with running_router(routing, tmp_path / "router.log", *args) as started:
        started.wait_ready()
        yield started


def test_half_sent_headers_are_cut_off_within_the_header_timeout(router: ServerProcess) -> None:
    assert_half_headers_cut_off(router.url, 20, HEADER_S)
    assert router_metric(router, REFUSALS, reason="header_timeout") == 20


def test_a_body_that_stops_gets_408_within_the_body_timeout(router: ServerProcess) -> None:
    assert_stopped_body_gets_408(router.url, BODY_S)
    assert router_metric(router, REFUSALS, reason="body_timeout") == 1


def test_a_client_that_stops_reading_is_cut_off_and_the_workers_request_ends(
    router: ServerProcess, worker: ServerProcess
) -> None:
    # The router relays no faster than its client reads: the router's write timeout
    # cuts the client off, which ends the worker's request.
    sock = start_unread_stream(router.url, "/v1/chat/completions", HEAVY_STREAM)
    try:
        wait_unread_stream_ended(router.url, worker)
    finally:
        sock.close()


def test_past_the_connection_cap_requests_get_503(capped: ServerProcess) -> None:
    extra = 3
    socks = [connect(capped.url) for _ in range(CONNECTIONS + extra)]
    try:
        for sock in socks:
            sock.sendall(request_head("/health"))
        answers = [read_answer(sock, 60) for sock in socks]
    finally:
        close_all(socks)
    statuses = [answer.status for answer in answers]
    # Connections the router had not yet seen closed (its readiness probes') may
    # still count: at least the extra ones are refused, never more admitted.
    refused = [answer for answer in answers if answer.status == 503]
    assert len(refused) >= extra and statuses.count(200) <= CONNECTIONS, statuses
    assert len(refused) + statuses.count(200) == len(socks), statuses
    for answer in refused:
        assert answer.headers["retry-after"] == "1"
        assert answer.headers["connection"] == "close"
        assert json.loads(answer.body)["error"]["code"] == "too_many_connections"
    counted, scrapes_refused = refusals_counted(capped.url, "connection_limit")
    assert counted == len(refused) + scrapes_refused


def test_past_the_body_read_cap_requests_get_503(capped: ServerProcess) -> None:
    body = json.dumps({"prompt": "hello there", "max_tokens": 2, "ignore_eos": True}).encode()
    socks = [send_partial_body(capped.url, body, 10) for _ in range(BODY_READS + 1)]
    try:
        # The router takes BODY_READS of the bodies; the one it cannot take is
        # answered at once (which one depends on the order it reads them in).
        first, index = first_answer(socks, 60)
        assert first.status == 503, first
        assert first.headers["retry-after"] == "1"
        assert json.loads(first.body)["error"]["code"] == "too_many_body_reads"
        taken = [sock for position, sock in enumerate(socks) if position != index]
        for sock in taken:
            sock.sendall(body[10:])
        assert [read_answer(sock, 300).status for sock in taken] == [200] * BODY_READS
    finally:
        close_all(socks)
    assert refusals_counted(capped.url, "body_read_limit")[0] == 1


def test_a_worker_at_its_caps_is_busy_not_failing(small_model_dir: Path, tmp_path: Path) -> None:
    async def refuse(_: web.Request) -> web.Response:
        busy = APIError(503, "full", "server_error", TOO_MANY_CONNECTIONS, {"Retry-After": "1"})
        return error_response(busy)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    body = {"prompt": "hello", "max_tokens": 2}

    async def scenario() -> tuple[list[int], dict[str, Any]]:
        async with serving(app) as url:
            routing = static_routing_file(tmp_path, small_model_dir, url, "busy")
            with running_router(routing, tmp_path / "router.log") as router:
                await asyncio.to_thread(router.wait_ready)
                async with aiohttp.ClientSession() as session:
                    statuses = []
                    for _ in range(3):  # as many as open a breaker on failures
                        async with session.post(
                            f"{router.url}/v1/completions", json=body
                        ) as answer:
                            statuses.append(answer.status)
                return statuses, await asyncio.to_thread(known_workers, router.url)

    statuses, workers = asyncio.run(scenario())
    assert statuses == [503] * 3
    assert [worker["state"] for worker in workers["decode"]] == ["closed"]


def first_answer(socks: list[socket.socket], limit_s: float) -> tuple[Answer, int]:
    """The first answer any of `socks` gets, and which socket got it."""
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(socks):
            selector.register(sock, selectors.EVENT_READ, index)
        ready = selector.select(timeout=limit_s)
    assert ready, f"no answer within {limit_s:g}s"
    index = ready[0][0].data
    return read_answer(socks[index], limit_s), index


def refusals_counted(url: str, reason: str) -> tuple[float, int]:
    """The router's count of refusals for `reason`, and how many of this call's own
    scrapes were refused (as a connection past the cap) before one was answered."""
    refused = 0
    deadline = time.monotonic() + 60
    while True:
        try:
            return total(f"{url}/metrics", REFUSALS, reason=reason), refused
        except urllib.error.HTTPError as error:
            if error.code != 503 or time.monotonic() > deadline:
                raise
            refused += 1
            time.sleep(0.1)
