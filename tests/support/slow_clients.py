"""Clients that cost a server what they can, on raw sockets: some send part of a
request and stop, some never read their answer. And what a process holds in memory.
Used by the network-limit tests and the slow-client benchmark."""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pdserve.workers.server.process import ServerProcess
from support.prom import total
from support.waiting import wait_until
from support.worker import wait_engine_emptied

# What a client that stops reading keeps receiving into (the kernel gives at least
# a few KiB): the server's side fills up sooner.
SMALL_RECEIVE_BUFFER = 4096
# A stream that fills a client's buffers fast: 16 choices, each token with its 20
# most likely alternatives (about 2 KB of SSE a token). 1900 tokens fit the tests'
# small model's context.
HEAVY_STREAM = {
    "messages": [{"role": "user", "content": "tell me everything"}],
    "n": 16, "max_tokens": 1900, "logprobs": True, "top_logprobs": 20,
    "stream": True, "ignore_eos": True,
}  # fmt: skip
# How late a cut-off may come in a test, as a multiple of its timeout: generous, so
# a loaded machine passes, and still seconds where there was no limit at all.
LATE = 10.0
# The servers' count of connections refused or cut off, by reason.
REFUSALS = "pdserve_http_connections_rejected_total"


def assert_cut_off(elapsed: float, timeout: float) -> None:
    """A client cut off after `elapsed` seconds was given its whole `timeout`, and
    not much more."""
    assert timeout - 0.01 <= elapsed <= LATE * timeout, (elapsed, timeout)


def connect(url: str, receive_buffer: int | None = None) -> socket.socket:
    """A TCP connection to the server at `url` (http://host:port)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # before connecting: it sets the window offered
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
    return sock


def request_head(path: str, content_length: int | None = None) -> bytes:
    """The request line and headers of a POST (JSON body) or, without a length, a GET."""
    if content_length is None:
        return f"GET {path} HTTP/1.1\r\nHost: pdserve\r\n\r\n".encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


def half_headers(path: str = "/v1/completions") -> bytes:
    """The first half of a request's headers (no blank line ends them)."""
    return request_head(path, 100)[:40]


def send_half_headers(url: str, path: str = "/v1/completions") -> socket.socket:
    """A connection that has sent half a request's headers and then nothing."""
    sock = connect(url)
    sock.sendall(half_headers(path))
    return sock


def send_partial_body(
    url: str, body: bytes, sent: int, path: str = "/v1/completions"
) -> socket.socket:
    """A connection that has sent a request's headers and the first `sent` bytes of
    its `body`, and then nothing."""
    sock = connect(url)
    sock.sendall(request_head(path, len(body)) + body[:sent])
    return sock


def start_unread_stream(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A streamed request whose client never reads a byte of the answer."""
    sock = connect(url, receive_buffer=SMALL_RECEIVE_BUFFER)
    data = json.dumps(body).encode()
    sock.sendall(request_head(path, len(data)) + data)
    return sock


@dataclass
class Answer:
    """What a server sent on a connection before it closed it."""

    status: int | None  # None: it closed without answering
    headers: dict[str, str]
    body: bytes
    closed_at: float  # time.monotonic() when the connection was seen closed


def wait_closed(sock: socket.socket, limit_s: float) -> Answer:
    """Read until the server closes the connection (or resets it); what it sent
    before. Fail if it is still open after `limit_s` seconds."""
    received = _receive(sock, limit_s, lambda _: False)
    if received is None:
        raise AssertionError(f"the connection is still open after {limit_s:g}s")
    return parse_answer(received, time.monotonic())


def read_answer(sock: socket.socket, limit_s: float) -> Answer:
    """Read one answer (with a Content-Length) without waiting for the connection to
    close; `closed_at` is when it was read."""
    received = _receive(sock, limit_s, _whole_answer)
    if received is None:
        raise AssertionError(f"no whole answer after {limit_s:g}s")
    return parse_answer(received, time.monotonic())


def _receive(sock: socket.socket, limit_s: float, enough: Callable[[bytes], bool]) -> bytes | None:
    """What the server sent until `enough` of it came or it closed the connection;
    None if neither happened within `limit_s`."""
    deadline = time.monotonic() + limit_s
    received = b""
    while not enough(received):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            break
        received += chunk
    return received


def _whole_answer(received: bytes) -> bool:
    head, found, body = received.partition(b"\r\n\r\n")
    if not found:
        return False
    length = parse_answer(head + found, 0.0).headers.get("content-length", "0")
    return len(body) >= int(length)


@contextmanager
def health_check(url: str) -> Iterator[tuple[Answer, socket.socket]]:
    """GET /health on a connection of its own, its headers sent in two pieces; the
    answer, the connection left open for the block."""
    head = request_head("/health")
    sock = connect(url)
    try:
        sock.sendall(head[:20])
        sock.sendall(head[20:])
        yield read_answer(sock, 60), sock
    finally:
        sock.close()


def wait_all_closed(socks: Sequence[socket.socket], limit_s: float) -> list[float]:
    """When (time.monotonic()) the server closed each connection, whatever it sent
    before; fail if any is still open `limit_s` seconds after this call."""
    started = time.monotonic()
    closed: dict[int, float] = {}
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(socks):
            selector.register(sock, selectors.EVENT_READ, index)
        while len(closed) < len(socks):
            left = started + limit_s - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{len(socks) - len(closed)} of {len(socks)} connections still open "
                    f"after {limit_s:g}s"
                )
            for key, _ in selector.select(timeout=left):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                sock = ready
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed[key.data] = time.monotonic()
                    selector.unregister(sock)
    return [closed[index] for index in range(len(socks))]


def parse_answer(data: bytes, closed_at: float) -> Answer:
    """An HTTP/1.1 answer (with a Content-Length) from its bytes."""
    if not data:
        return Answer(None, {}, b"", closed_at)
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split()[1]), headers, body, closed_at)


def close_all(socks: Sequence[socket.socket]) -> None:
    """Close connections this side holds."""
    for sock in socks:
        sock.close()


def assert_half_headers_cut_off(url: str, count: int, timeout: float) -> None:
    """`count` connections that send half their headers are each closed by the server
    within `timeout` of their first byte (see `assert_cut_off`)."""
    sent, socks = [], []
    for _ in range(count):
        sent.append(time.monotonic())
        socks.append(send_half_headers(url))
    try:
        closed = wait_all_closed(socks, LATE * timeout)
    finally:
        close_all(socks)
    for began, ended in zip(sent, closed, strict=True):
        assert_cut_off(ended - began, timeout)


def assert_stopped_body_gets_408(url: str, timeout: float) -> None:
    """A request whose body stops coming gets 408 within `timeout` of its headers, and
    its connection is closed."""
    body = json.dumps({"prompt": "a slow body", "max_tokens": 2}).encode()
    began = time.monotonic()
    sock = send_partial_body(url, body, 10)
    try:
        answer = wait_closed(sock, LATE * timeout)
    finally:
        sock.close()
    assert (answer.status, answer.headers["connection"]) == (408, "close")
    assert json.loads(answer.body)["error"]["code"] == "body_timeout"
    assert_cut_off(answer.closed_at - began, timeout)


def wait_unread_stream_ended(server_url: str, worker: ServerProcess) -> None:
    """Wait until the server at `server_url` has cut off the one client that stopped
    reading its stream (its write timeout runs once the connection's buffers are full:
    how soon the engine fills them depends on the machine), and `worker`'s request for
    it has been aborted and its KV cache freed."""
    wait_until(
        lambda: total(f"{server_url}/metrics", REFUSALS, reason="write_timeout") == 1, 600,
        "the client that stopped reading to be cut off",
    )  # fmt: skip
    wait_until(
        lambda: total(f"{worker.url}/metrics", "pdserve_requests_total", finish_reason="abort")
        == 1,
        60, "the worker's request to be aborted",
    )  # fmt: skip
    wait_engine_emptied(worker)


def rss_bytes(pid: int) -> int:
    """The resident memory of a process on this machine (Linux's /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
