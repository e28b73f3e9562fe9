"""The router's client to its workers, against scripted HTTP servers on real sockets:
answers framed every way a worker may frame them, cut anywhere across reads; kept-alive
connections reused, and a request sent again when a kept-alive connection was closed
as it was reused; answers given up close their connection; a malformed answer or an
unreachable worker is an UpstreamError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from pdserve.workers.router.upstream import BUFFER_LIMIT, UpstreamError, Upstreams, _Body

# A script answers one request on a connection: it gets the request's head and body
# and the writer; it returns False to close the connection after it.
Script = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[bool]]


class Scripted:
    """A server answering each request with a script, counting connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.script(head, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()


@asynccontextmanager
async def serving(script: Script) -> AsyncIterator[tuple[Scripted, str]]:
    scripted = Scripted(script)
    server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield scripted, f"http://127.0.0.1:{port}"
    finally:
        server.close()


def answering(*parts: bytes, keep: bool = True) -> Script:
    """A script writing `parts` one by one."""

    async def script(_: bytes, __: bytes, writer: asyncio.StreamWriter) -> bool:
        for part in parts:
            writer.write(part)
            await writer.drain()
        return keep

    return script


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return body + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Pdserve-Mode: colocated\r\n"


def cut(data: bytes, size: int) -> list[bytes]:
    return [data[at : at + size] for at in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
async def test_a_chunked_answer_cut_anywhere_arrives_whole(size: int) -> None:
    events = [b"data: %d\n\n" % n for n in range(20)]
    answer = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(*events)
    async with serving(answering(*cut(answer, size))) as (_, url):
        upstreams = Upstreams(1.0)
        async with await upstreams.post(url, "/v1/completions", b"{}", {}) as response:
            assert response.status == 200
            assert response.header("x-pdserve-mode") == "colocated"
            assert response.header("X-PDSERVE-MODE") == "colocated"
            assert await response.read() == b"".join(events)
        upstreams.close()


async def test_answers_framed_by_length_and_by_close() -> None:
    by_length = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nhello"
    async with serving(answering(*cut(by_length, 4))) as (_, url):
        upstreams = Upstreams(1.0)
        async with await upstreams.post(url, "/x", b"{}", {}) as response:
            assert response.status == 400 and await response.read() == b"hello"
    by_close = b"HTTP/1.0 200 OK\r\n\r\nuntil the end"
    async with serving(answering(by_close, keep=False)) as (_, url):
        response = await upstreams.post(url, "/x", b"{}", {})
        async with response:
            assert await response.read() == b"until the end"


async def test_connections_are_kept_alive_and_the_request_is_sent_whole() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with serving(answering(answer)) as (server, url):
        upstreams = Upstreams(1.0)
        for n in range(3):
            headers = {"X-Request-Id": f"r-{n}", "Authorization": "Bearer secret"}
            async with await upstreams.post(url, "/v1/completions", b'{"a":1}', headers) as reply:
                assert await reply.read() == b"ok"
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        for line in (b"Content-Length: 7", b"X-Request-Id: r-0", b"Authorization: Bearer secret"):
            assert line in first.split(b"\r\n")
        assert first.endswith(b'\r\n\r\n{"a":1}')
        upstreams.close()


async def test_a_kept_alive_connection_closed_by_the_worker_is_replaced() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with serving(answering(answer, keep=False)) as (server, url):
        upstreams = Upstreams(1.0)
        for _ in range(3):
            async with await upstreams.post(url, "/x", b"{}", {}) as reply:
                assert await reply.read() == b"ok"
            await server.closed.wait()  # the worker closed it once answered
            server.closed.clear()
        assert server.connections == 3
        async with asyncio.timeout(5):  # once the close reaches the client
            while upstreams._pools:  # a worker whose connections closed leaves nothing
                await asyncio.sleep(0.01)


async def test_an_answer_given_up_closes_its_connection() -> None:
    answer = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"5\r\nhello\r\n"

    async def stream(_: bytes, __: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer)
        while True:  # a token now and then, until the client is gone
            await asyncio.sleep(0.05)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()

    async with serving(stream) as (server, url):
        upstreams = Upstreams(1.0)
        async with await upstreams.post(url, "/x", b"{}", {}) as reply:
            assert await reply.next_piece() == b"hello"
        await asyncio.wait_for(server.closed.wait(), 5)  # the worker sees its client gone


async def test_a_slow_taker_holds_the_worker_back() -> None:
    """Reading stops while more than the buffer limit waits to be taken."""
    piece = b"x" * 16384
    count = 4 * BUFFER_LIMIT // len(piece)
    answer = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(*[piece] * count)
    async with serving(answering(answer)) as (_, url):
        upstreams = Upstreams(1.0)
        async with await upstreams.post(url, "/x", b"{}", {}) as reply:
            await asyncio.sleep(0.2)  # the worker writes all it can meanwhile
            assert reply._buffered <= BUFFER_LIMIT + 65536  # at most a read past the limit
            assert len(await reply.read()) == len(piece) * count


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a size not in hex
        b"SPDY/3 200 OK\r\n\r\n",  # not HTTP/1
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # then closed
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    ],
)
async def test_a_malformed_or_broken_answer_is_an_upstream_error(answer: bytes) -> None:
    async with serving(answering(answer, keep=False)) as (_, url):
        upstreams = Upstreams(1.0)
        with pytest.raises(UpstreamError):
            async with await upstreams.post(url, "/x", b"{}", {}) as reply:
                await reply.read()


async def test_an_unreachable_worker_or_a_header_injection_is_an_upstream_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    upstreams = Upstreams(1.0)
    with pytest.raises(UpstreamError, match="cannot connect"):
        await upstreams.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
    with pytest.raises(UpstreamError, match="line break"):
        await upstreams.post(f"http://127.0.0.1:{port}", "/x", b"{}", {"X-A": "a\r\nX-B: b"})
    with pytest.raises(UpstreamError, match="http://"):
        await upstreams.post("https://127.0.0.1:1", "/x", b"{}", {})


async def test_an_answer_ended_later_keeps_its_connection_if_its_end_comes() -> None:
    """Past a stream's last event its taker is done; the connection is kept when the
    answer's end follows in time, closed when it does not."""
    events = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"5\r\nhello\r\n"
    ends = iter([True, False])

    async def stream(_: bytes, __: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(events)
        await asyncio.sleep(0.1)
        if next(ends):
            writer.write(b"0\r\n\r\n")
            return True
        while True:  # more, but never the end, until the router closes the connection
            await asyncio.sleep(0.05)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()

    async with serving(stream) as (server, url):
        upstreams = Upstreams(1.0)
        for within_s in (5.0, 0.2):
            async with await upstreams.post(url, "/x", b"{}", {}) as reply:
                assert await reply.next_piece() == b"hello"
                reply.end_later(within_s)
            async with asyncio.timeout(5):  # the first answer's end comes
                while within_s == 5.0 and not upstreams._pools[url]._idle:
                    await asyncio.sleep(0.01)
        assert server.connections == 1  # the first answer's end came: its connection reused
        await asyncio.wait_for(server.closed.wait(), 5)  # the second's did not: closed


_CHUNKED_BODIES = [
    (chunked(b"data: 1\n\n", b"x" * 300, b"data: [DONE]\n\n"), b"data: 1\n\n" + b"x" * 300
     + b"data: [DONE]\n\n", False),
    (b"5;name=value\r\nhello\r\nA \r\n0123456789\r\n0\r\n\r\n", b"hello0123456789", False),
    (b"3\r\nabc\r\n0\r\nTrailer: yes\r\n\r\n", b"abc", False),  # a trailer
    (b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200", b"abc", True),  # bytes after the end
    (b"0X3\r\nabc\r\n0\r\n\r\n", b"abc", False),  # int() takes the prefix: so does this
    # CRLFs within chunks, one cut where a size line would be.
    (b"8\r\nab\r\ncd\r\n\r\n2\r\n\r\n\r\n0\r\n\r\n", b"ab\r\ncd\r\n\r\n", False),
    (b"4\r\n1\r\nx\r\n0\r\n\r\n", b"1\r\nx", False),
]  # fmt: skip


@pytest.mark.parametrize(("wire", "body", "trailing"), _CHUNKED_BODIES)
def test_a_chunked_body_decodes_alike_however_it_is_cut(
    wire: bytes, body: bytes, trailing: bool
) -> None:
    for first in range(len(wire) + 1):
        for second in (first, min(len(wire), first + 1), min(len(wire), first + 9)):
            decoder = _Body.of({"transfer-encoding": "chunked"}, 200)
            pieces, ended = [], False
            for part in (wire[:first], wire[first:second], wire[second:]):
                got, ended = decoder.decode(part)
                pieces += got
            assert (b"".join(pieces), ended, decoder.trailing) == (body, True, trailing)


@pytest.mark.parametrize(
    "wire",
    [b"zz\r\n", b"-3\r\nabc\r\n", b"+3\r\nabc\r\n", b"3\r\nabcXY", b"\r\n", b"1_0\r\n", b"3 x\r\n"],
)
def test_a_malformed_chunk_is_refused(wire: bytes) -> None:
    with pytest.raises(UpstreamError):
        _Body.of({"transfer-encoding": "chunked"}, 200).decode(wire)


@pytest.mark.parametrize("length", ["-1", "+3", "1e3", "3 4", "\u0663", "9" * 5000])
def test_a_content_length_that_is_not_a_byte_count_is_refused(length: str) -> None:
    with pytest.raises(UpstreamError, match="malformed Content-Length"):
        _Body.of({"content-length": length}, 200)
