"""The router's HTTP/1.1 server at its extremes, on raw sockets: heads too large, bad
chunk sizes, bodies over the limit, pipelined requests answered in order, keep-alive
and close, `Expect: 100-continue`, HTTP/1.0 streams, and a client that goes away
mid-stream cancelling its request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from pdserve.workers.network.guard import NetworkGuard
from pdserve.workers.network.http1 import MAX_HEAD_BYTES, MAX_HEADERS, Answer, Http1Server, Request
from pdserve.workers.network.limits import NetworkLimits
from pdserve.workers.network.metrics import NetworkMetrics

MAX_BODY = 1024


class Echo:
    """Answers a request with what it received; /stream streams until the client
    leaves (and records that it was cancelled)."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.streaming = asyncio.Event()

    async def __call__(self, request: Request) -> Answer:
        if request.path == "/stream":
            return await self._stream(request)
        body = await request.read()
        echoed = {"method": request.method, "path": request.path, "body": body.decode()}
        return web.json_response(echoed)

    async def _stream(self, request: Request) -> Answer:
        answer = request.stream({"Content-Type": "text/event-stream"})
        try:
            for number in range(3 if request.version == "1.0" else 1_000_000):
                await answer.write(b"data: %d\n\n" % number)
                self.streaming.set()
                await asyncio.sleep(0.001)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise
        await answer.write_eof()
        return answer


@asynccontextmanager
async def serving(handler: Callable[[Request], Any], **limits: Any) -> AsyncIterator[int]:
    guard = NetworkGuard(
        NetworkLimits(**limits), NetworkMetrics(CollectorRegistry(), "test", "router")
    )
    server = Http1Server(handler, guard, MAX_BODY)
    port = await server.listen("127.0.0.1", 0)
    try:
        yield port
    finally:
        await server.shutdown(1.0)


async def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data`, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def answers(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The Content-Length framed answers in `raw`, in order."""
    found = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = int(headers.get("content-length", len(raw)))
        found.append((int(status_line.split()[1]), headers, raw[:length]))
        raw = raw[length:]
    return found


def post(path: str, body: bytes, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def run(test: Callable[[], Any]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            requests = [post(f"/{n}", b"x" * n) for n in range(1, 6)]
            last = post("/last", b"end", "Connection: close")
            got = answers(await exchange(port, b"".join(requests) + last))
        assert [status for status, _, _ in got] == [200] * 6
        bodies = [json.loads(body) for _, _, body in got]
        assert [b["path"] for b in bodies] == ["/1", "/2", "/3", "/4", "/5", "/last"]
        assert [b["body"] for b in bodies] == ["x", "xx", "xxx", "xxxx", "xxxxx", "end"]
        assert got[-1][1]["connection"] == "close"

    run(test)


def test_headers_reach_the_handler_as_sent() -> None:
    """Names in any case, empty values, repeated names, colons, spaces and latin-1
    bytes within values (trailing spaces as llhttp leaves them); and a request with
    no header at all."""

    async def headers(request: Request) -> Answer:
        return web.json_response(list(request.headers.items()))

    async def test() -> None:
        extra = ["x-lower: a", "X-Empty:", "X-Twice: 1", "X-Twice: 2", "X-Colon: a: b c",
                 "X-Spaces:   padded   "]  # fmt: skip
        async with serving(headers) as port:
            # A value's byte 0xE9 (latin-1's e acute), sent as is.
            raw = post("/", b"", *extra, "X-Latin: caf~", "Connection: close").replace(
                b"~", b"\xe9"
            )
            (sent,) = answers(await exchange(port, raw))
            (bare,) = answers(await exchange(port, b"GET / HTTP/1.0\r\n\r\n"))
        assert sent[0] == 200 and json.loads(sent[2]) == [
            ["Host", "x"], ["Content-Length", "0"], ["x-lower", "a"], ["X-Empty", ""],
            ["X-Twice", "1"], ["X-Twice", "2"], ["X-Colon", "a: b c"], ["X-Spaces", "padded   "],
            ["X-Latin", "caf\u00e9"], ["Connection", "close"],
        ]  # fmt: skip
        assert bare[0] == 200 and json.loads(bare[2]) == []

    run(test)


def test_a_head_over_the_limit_gets_431_and_the_connection_closes() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            huge = "X-Big: " + "a" * (MAX_HEAD_BYTES + 10)
            got = answers(await exchange(port, post("/", b"{}", huge)))
            many = [f"X-{n}: {n}" for n in range(MAX_HEADERS + 1)]
            counted = answers(await exchange(port, post("/", b"{}", *many)))
        for status, headers, body in (*got, *counted):
            assert status == 431 and headers["connection"] == "close"
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert len(got) == len(counted) == 1

    run(test)


def test_bad_chunk_sizes_get_400_and_the_connection_closes() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            for sizes in (b"zz\r\nab\r\n0\r\n\r\n", b"-5\r\nabcde\r\n0\r\n\r\n",
                          b"3\r\nabcdef\r\n0\r\n\r\n"):  # fmt: skip
                head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                got = answers(await exchange(port, head + sizes))
                assert [status for status, _, _ in got] == [400], (sizes, got)
                assert "malformed request" in json.loads(got[0][2])["error"]["message"]

    run(test)


def test_a_good_chunked_body_is_received_whole() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            head = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            chunks = b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n"
            got = answers(await exchange(port, head + b"Connection: close\r\n\r\n" + chunks))
        assert json.loads(got[0][2])["body"] == "abcde"

    run(test)


def test_bodies_over_the_limit_get_413_before_they_are_read() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            # Announced: refused at once, with none of the body sent.
            head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
            announced = answers(await exchange(port, head.encode()))
            # Chunked: refused once it grows past the limit.
            chunked = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            chunk = b"%x\r\n%s\r\n" % (MAX_BODY + 1, b"a" * (MAX_BODY + 1))
            grown = answers(await exchange(port, chunked + chunk))
        for got in (announced, grown):
            assert [status for status, _, _ in got] == [413]
            assert got[0][1]["connection"] == "close"

    run(test)


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = (
                b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
            )
            writer.write(head)
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert interim.startswith(b"HTTP/1.1 100 ")
            writer.write(b"ok")
            head_line = await asyncio.wait_for(reader.readline(), 10)
            assert head_line.startswith(b"HTTP/1.1 200 ")
            writer.close()

    run(test)


def test_a_client_gone_mid_stream_cancels_its_request() -> None:
    async def test() -> None:
        handler = Echo()
        async with serving(handler) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert b"transfer-encoding: chunked" in head.lower()
            await asyncio.wait_for(reader.readuntil(b"data: 0\n\n"), 10)
            writer.transport.abort()
            await asyncio.wait_for(handler.cancelled.wait(), 10)

    run(test)


def test_an_http10_stream_ends_with_the_connection() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            raw = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding" not in head
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"

    run(test)


def test_head_answers_carry_no_body_and_keep_the_connection() -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            raw = await exchange(
                port,
                b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /g HTTP/1.1\r\nConnection: close\r\n\r\n",
            )
        first, _, rest = raw.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200") and b"Content-Length: " in first
        assert rest.startswith(b"HTTP/1.1 200")
        assert json.loads(answers(rest)[0][2])["path"] == "/g"

    run(test)


@pytest.mark.parametrize("garbage", [b"\x00\x01\x02 nonsense\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n"])
def test_garbage_gets_400(garbage: bytes) -> None:
    async def test() -> None:
        async with serving(Echo()) as port:
            got = answers(await exchange(port, garbage))
        assert [status for status, _, _ in got] == [400]

    run(test)


def test_half_sent_heads_are_cut_off_and_idle_connections_closed() -> None:
    async def test() -> None:
        async with serving(Echo(), timeout_request_headers=0.2, timeout_keep_alive=0.2) as port:
            assert await exchange(port, b"GET / HTTP/1.1\r\nHost:") == b""
            assert await exchange(port, b"") == b""

    run(test)


class Slow(Echo):
    """Echo, but /slow answers once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()

    async def __call__(self, request: Request) -> Answer:
        if request.path == "/slow":
            self.waiting.set()
            await self.release.wait()
        return await super().__call__(request)


def test_a_kept_alive_connection_answers_request_after_request() -> None:
    """Requests sent one after another on one connection, each once the last was
    answered (the connection waits idle between them), are all answered."""

    async def test() -> None:
        async with serving(Echo()) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for n in range(5):
                writer.write(post(f"/{n}", b"x"))
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                assert json.loads(await reader.readexactly(length))["path"] == f"/{n}"
                await asyncio.sleep(0.01)
            writer.close()

    run(test)


def test_shutdown_waits_for_requests_under_way_not_for_idle_connections() -> None:
    async def test() -> None:
        handler = Slow()
        guard = NetworkGuard(NetworkLimits(), NetworkMetrics(CollectorRegistry(), "t", "router"))
        server = Http1Server(handler, guard, MAX_BODY)
        port = await server.listen("127.0.0.1", 0)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(post("/first", b"x"))  # answered, then the connection idles
        await idle_reader.readuntil(b"\r\n\r\n")
        busy = asyncio.create_task(exchange(port, post("/slow", b"y")))
        await handler.waiting.wait()
        stopping = asyncio.create_task(server.shutdown(10.0))
        # The idle connection: the rest of its answer, then closed at once.
        assert json.loads(await asyncio.wait_for(idle_reader.read(), 2.0))["path"] == "/first"
        await asyncio.sleep(0.05)
        assert not stopping.done()  # the request under way is waited for
        handler.release.set()
        (status, _, body), *_ = answers(await busy)
        assert status == 200 and json.loads(body)["path"] == "/slow"
        await asyncio.wait_for(stopping, 2.0)
        idle_writer.close()

    run(test)


def test_the_keep_alive_timeout_counts_from_the_last_answer() -> None:
    """A connection idle for less than the timeout since its last answer stays open,
    though longer since it was first idle; idle past the timeout, it is closed."""

    async def test() -> None:
        async with serving(Echo(), timeout_keep_alive=1.0) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)

            async def ask(path: str) -> str:
                writer.write(post(path, b"x"))
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                return str(json.loads(await reader.readexactly(length))["path"])

            await asyncio.sleep(0.6)
            assert await ask("/a") == "/a"
            await asyncio.sleep(0.6)  # 1.2 s since the connection opened
            assert await ask("/b") == "/b"
            assert await asyncio.wait_for(reader.read(), 10.0) == b""  # then closed
            writer.close()

    run(test)
