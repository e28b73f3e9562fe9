"""The router's client to its workers: HTTP/1.1 POSTs over kept-alive connections, a
pool of idle ones per worker.

The router makes one kind of call on every request: a JSON body POSTed to a worker,
whose answer is read whole or relayed as it streams. aiohttp's `ClientSession` does
much more per call (cookies, tracing hooks, redirects, timers, its request and
response objects and their streams), and it was the largest cost of the router's
per-request path; this client does only what that call needs.

An answer is framed by its Content-Length, by chunked transfer coding, or by the
connection's close. A connection goes back to its pool only once its answer was read
to the end and both sides keep it alive; an answer given up before its end closes
its connection (the worker sees its client gone and aborts the request). Reading
pauses while more than `BUFFER_LIMIT` bytes wait to be taken, so a slow client holds
the worker's stream back rather than filling the router's memory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from itertools import repeat
from types import TracebackType
from typing import cast
from urllib.parse import urlsplit

from pdserve.protocol.headers import header_count

BUFFER_LIMIT = 64 * 1024  # bytes of an answer read ahead of its taker
MAX_HEAD_BYTES = 64 * 1024  # a status line and headers larger than this are refused
IDLE_S = 15.0  # an idle connection is kept this long
_MOST_BODY_BYTES = 1 << 62  # a larger Content-Length is not a body but a bad answer


class UpstreamError(Exception):
    """The worker could not be reached, or its answer broke off or was malformed."""


class _NothingReceived(UpstreamError):
    """A connection was closed before any byte of the answer (a kept-alive one the
    worker closed as it was reused: the request can be sent again on a new one)."""


class UpstreamResponse:
    """A worker's answer: its status and headers at once, its body as it arrives.

    Use it as an async context manager: leaving it returns the connection to its pool
    when the body was read to its end, and closes it otherwise."""

    def __init__(self, connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self._headers = headers  # by lower-case name
        self._connection = connection
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._ended = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._ending: asyncio.TimerHandle | None = None  # see end_later

    def header(self, name: str, default: str | None = None) -> str | None:
        """The value of header `name` (any case), or `default`."""
        return self._headers.get(name.lower(), default)

    @property
    def headers(self) -> Mapping[str, str]:
        """The headers, by lower-case name."""
        return self._headers

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Done with the answer: its connection is kept if the answer was read whole."""
        if self._ending is None:
            self._connection.release(self)

    def end_later(self, within_s: float) -> None:
        """Done with the answer, though its last bytes may still be on their way (what
        follows a stream's end: its chunked coding's end). They are read and dropped
        as they come; the connection is kept if the answer ends within `within_s`, else
        closed."""
        self._pieces.clear()
        self._buffered = 0
        self._connection.taken()
        if self._ended:
            self._connection.release(self)
            return
        self._ending = self._connection.loop.call_later(within_s, self._connection.abort)

    async def read(self) -> bytes:
        """The whole body (UpstreamError when it breaks off)."""
        pieces = []
        while (piece := await self.next_piece()) is not None:
            pieces.append(piece)
        return b"".join(pieces)

    async def next_piece(self) -> bytes | None:
        """The body's next piece as it arrives (all that had arrived when it is taken);
        None once it ended (UpstreamError when it broke off). No async generator: the
        event loop tracks each in a set of its own, and mypyc compiles none."""
        while True:
            if self._pieces:
                return self._take()
            if self._error is not None:
                raise self._error
            if self._ended:
                return None
            self._waiter = self._connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _take(self) -> bytes:
        pieces = self._pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        self._connection.taken()
        return data

    # -- fed by the connection ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._ending is not None:
            return  # nobody takes it
        self._pieces.append(data)
        self._buffered += len(data)
        self._wake()

    def _end(self, error: UpstreamError | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._error = error
            self._wake()
            if self._ending is not None:
                self._ending.cancel()
                self._connection.release(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def complete(self) -> bool:
        """Whether the body was read to its end without error."""
        return self._ended and self._error is None and not self._pieces


class _Connection(asyncio.Protocol):
    """One connection to a worker, parsing the answers it carries."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        # Kept: asking asyncio for the running loop costs a getpid() call each time.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.reused = False
        self._buffer = bytearray()  # received, not yet parsed
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._keep_alive = True
        self._received = False  # any byte of the current answer
        self._paused = False
        self._body: _Body | None = None

    # -- the asyncio protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no subclasses of asyncio's, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.forget(self)
        why = f": {exc}" if exc is not None else ""
        if self._head is not None and not self._head.done():
            kind = UpstreamError if self._received else _NothingReceived
            self._head.set_exception(kind(f"the worker closed the connection{why}"))
        if self._response is not None:
            body = self._body
            if body is not None and body.until_close:
                self._response._end()
            else:
                self._response._end(UpstreamError(f"the answer broke off{why}"))

    def data_received(self, data: bytes) -> None:
        self._received = True
        if self._head is None and self._response is None:
            self.abort()  # bytes nothing was asked for: the connection is not to be trusted
            return
        try:
            self._parse(data)
        except UpstreamError as error:
            self._fail(error)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost ends the answer

    # -- a request ----------------------------------------------------------------------

    async def send(self, request: bytes) -> UpstreamResponse:
        """Send `request` (a whole HTTP/1.1 request) and wait for its answer's head."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise _NothingReceived("the connection is closed")
        self._head = self.loop.create_future()
        self._received = False
        transport.write(request)
        try:
            return await self._head
        except BaseException:  # cancelled, or no answer: the worker's request must end
            self.abort()
            raise
        finally:
            self._head = None

    def release(self, response: UpstreamResponse) -> None:
        """The answer's taker is done with it."""
        if self._response is not response:
            return
        self._response = None
        self._body = None
        if response.complete and self._keep_alive and self.transport is not None:
            self.pool.keep(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Drop the connection now."""
        if self.transport is not None:
            self.transport.abort()

    def taken(self) -> None:
        """The answer's taker took what was buffered: read on."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    # -- parsing ------------------------------------------------------------------------

    def _parse(self, data: bytes) -> None:
        if self._body is not None:
            self._body_data(data)
            return
        buffer = self._buffer
        if buffer:  # the head's start came in an earlier read
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_HEAD_BYTES:
                raise UpstreamError("the answer's headers are too large")
            buffer += data
            return
        head = data[:end]
        rest = data[end + 4 :]
        status, headers, version = _parse_head(head)
        if 100 <= status < 200:  # an interim answer: the real one follows
            if rest:
                self._parse(rest)
            return
        self._keep_alive = _keeps_alive(version, headers)
        response = UpstreamResponse(self, status, headers)
        self._response = response
        self._body = _Body.of(headers, status)
        if self._head is not None and not self._head.done():
            self._head.set_result(response)
        if rest or self._body.ended:
            self._body_data(rest)

    def _body_data(self, data: bytes) -> None:
        body, response = self._body, self._response
        assert body is not None and response is not None
        pieces, ended = body.decode(data)
        if pieces:  # what one read brought goes to the taker as one piece
            response._feed(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if ended:
            if body.trailing:  # bytes after the answer: nothing was asked for them
                self._keep_alive = False
            response._end()
        elif response._buffered > BUFFER_LIMIT and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()

    def _fail(self, error: UpstreamError) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        if self._response is not None:
            self._response._end(error)
        self._keep_alive = False
        self.abort()


class _Body:
    """The framing of one answer's body, and decoding it as it arrives."""

    def __init__(self, length: int | None, chunked: bool) -> None:
        self.length = length  # bytes left, when framed by Content-Length
        self.chunked = chunked
        self.until_close = length is None and not chunked
        self.ended = length == 0
        self.trailing = False
        self._pending = bytearray()  # of a chunked body, not yet decoded
        self._chunk_left = -1  # -1: a chunk's size line is next; -2: the trailer

    @classmethod
    def of(cls, headers: Mapping[str, str], status: int) -> _Body:
        """The framing the headers say."""
        if status in (204, 304):
            return cls(0, False)
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.strip().lower() != "chunked":
                raise UpstreamError(f"unsupported transfer coding {coding!r}")
            return cls(None, True)
        length = headers.get("content-length")
        if length is None:
            return cls(None, False)
        size = header_count(length.strip(), _MOST_BODY_BYTES)
        if size is None:
            raise UpstreamError(f"malformed Content-Length {length[:40]!r}")
        return cls(size, False)

    def decode(self, data: bytes) -> tuple[list[bytes], bool]:
        """The body's bytes in `data`, and whether the body ended."""
        if self.ended:
            self.trailing = self.trailing or bool(data)
            return [], True
        if self.chunked:
            return self._chunks(data)
        if self.length is None:
            return [data], False
        if len(data) > self.length:
            self.trailing = True
            data = data[: self.length]
        self.length -= len(data)
        self.ended = self.length == 0
        return [data], self.ended

    def _chunks(self, data: bytes) -> tuple[list[bytes], bool]:
        pending = self._pending
        if not pending and self._chunk_left == -1:  # at a chunk's start
            whole = _whole_chunks(data)
            if whole is not None:
                self.ended = whole[1]
                return whole
        if pending:  # what an earlier read left undecoded, then this one
            pending += data
            data = bytes(pending)
            pending.clear()
        pieces: list[bytes] = []
        at = 0
        size = len(data)
        left = self._chunk_left  # kept in a local while the loop runs: read per chunk
        while True:
            if left > 0:  # a chunk's data, then its CRLF
                end = at + left
                if size < end + 2:
                    if size > at:
                        taken = min(size, end) - at
                        pieces.append(data[at : at + taken])
                        left -= taken
                        at += taken
                    break
                pieces.append(data[at:end])
                if data[end : end + 2] != b"\r\n":
                    raise UpstreamError("malformed chunked body")
                at = end + 2
                left = -1
            elif left == 0:  # the CRLF after a chunk whose data came earlier
                if size < at + 2:
                    break
                if data[at : at + 2] != b"\r\n":
                    raise UpstreamError("malformed chunked body")
                at += 2
                left = -1
            else:  # a size line, or a trailer line (the body ends at an empty one)
                line_end = data.find(b"\r\n", at)
                if line_end < 0:
                    if size - at > MAX_HEAD_BYTES:
                        raise UpstreamError("malformed chunked body")
                    break
                line = data[at:line_end]
                at = line_end + 2
                if left == -2:
                    if not line:
                        self.ended = True
                        break
                    continue
                left = _chunk_size(line) or -2
                if left > 0 and size >= at + left + 2:  # the whole chunk is here
                    end = at + left
                    pieces.append(data[at:end])
                    if data[end : end + 2] != b"\r\n":
                        raise UpstreamError("malformed chunked body")
                    at = end + 2
                    left = -1
        self._chunk_left = left
        if at < size:
            pending += data[at:]
            self.trailing = self.trailing or self.ended
        return pieces, self.ended


def _whole_chunks(data: bytes) -> tuple[list[bytes], bool] | None:
    """The chunks `data` holds, and whether the body ended with them, when it is whole
    chunks (as a worker's stream arrives: none cut, no CRLF within one, no extensions,
    no trailers), read with loops in C; None for anything else (for `_Body._chunks`).
    Cut at every CRLF, such data alternates size lines and chunks: a chunk holding a
    CRLF would be cut shorter than its size line says, and is found out."""
    parts = data.split(b"\r\n")
    if len(parts) < 3 or len(parts) % 2 == 0 or parts[-1]:
        return None
    sizes, chunks = parts[0:-1:2], parts[1:-1:2]
    if not all(map(bytes.isalnum, sizes)):  # no sign, space or underscore int() takes
        return None
    try:
        lengths = list(map(int, sizes, repeat(16)))
    except ValueError:
        return None
    if lengths != list(map(len, chunks)) or 0 in lengths[:-1]:
        return None  # cut elsewhere, or bytes after the body's end
    if lengths[-1] == 0:  # the last chunk, then the empty line that ends the trailer
        return chunks[:-1], True
    return chunks, False


def _chunk_size(line: bytes) -> int:
    # A size alone, as nearly every server writes it, needs no splitting off of
    # extensions.
    size = line if line.isalnum() else line.split(b";", 1)[0].strip()
    try:
        if size.isalnum():  # no sign, no space, no underscore int() would take
            return int(size, 16)
    except ValueError:
        pass
    raise UpstreamError("malformed chunk size")


def _parse_head(head: bytes) -> tuple[int, dict[str, str], str]:
    """Status, headers (by lower-case name; repeated ones joined) and HTTP version."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise UpstreamError(f"malformed status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise UpstreamError(f"malformed header line {line[:80]!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(code), headers, version


def _keeps_alive(version: str, headers: Mapping[str, str]) -> bool:
    connection = headers.get("connection", "").lower()
    if version == "HTTP/1.0":
        return "keep-alive" in connection
    return "close" not in connection


class _Pool:
    """The connections to one worker: idle ones are reused, newest first. `emptied` is
    called when its last idle connection closed (a worker that is gone leaves nothing)."""

    def __init__(self, url: str, host: str, port: int, emptied: Callable[[_Pool], None]) -> None:
        self.url = url
        self.host = host
        self.port = port
        self.authority = f"{host}:{port}"
        self._idle: list[_Connection] = []
        self._emptied = emptied

    def idle(self) -> _Connection | None:
        """An idle connection still open, if any."""
        while self._idle:
            connection = self._idle.pop()
            transport = connection.transport
            if transport is not None and not transport.is_closing():
                return connection
        return None

    async def connect(self, timeout_s: float) -> _Connection:
        """A new connection (UpstreamError when it cannot be made within `timeout_s`)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port
                )
        except TimeoutError:
            raise UpstreamError(f"connecting took over {timeout_s:g} s") from None
        except OSError as error:
            raise UpstreamError(f"cannot connect: {error}") from error
        return connection

    def keep(self, connection: _Connection) -> None:
        """A connection whose answer ended, kept for the next request; connections
        idle longer than IDLE_S are closed."""
        now = time.monotonic()
        connection.idle_since = now
        connection.reused = True
        self._idle.append(connection)
        while self._idle and now - self._idle[0].idle_since > IDLE_S:
            self._idle.pop(0).abort()

    def forget(self, connection: _Connection) -> None:
        """A connection closed."""
        if connection in self._idle:
            self._idle.remove(connection)
            if not self._idle:
                self._emptied(self)

    def close(self) -> None:
        """Close every idle connection."""
        while self._idle:
            self._idle.pop().abort()


class Upstreams:
    """Kept-alive connections to the workers, a pool per worker URL (http://host:port)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._pools: dict[str, _Pool] = {}

    def _pool(self, url: str) -> _Pool:
        pool = self._pools.get(url)
        if pool is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or parts.hostname is None:
                raise UpstreamError(f"not an http:// worker URL: {url!r}")
            pool = self._pools[url] = _Pool(url, parts.hostname, parts.port or 80, self._forget)
        return pool

    def _forget(self, pool: _Pool) -> None:
        """Drop an emptied pool (the next request to its worker makes a new one)."""
        if self._pools.get(pool.url) is pool:
            del self._pools[pool.url]

    async def post(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        """POST `body` (JSON) to the worker at `url`; its answer once its head arrived.
        UpstreamError when the worker cannot be reached or its answer is malformed."""
        pool = self._pool(url)
        request = _request(pool.authority, path, body, headers)
        connection = pool.idle()
        if connection is not None:
            try:
                return await connection.send(request)
            except _NothingReceived:
                pass  # the worker closed it as it was reused: once more on a new one
        connection = await pool.connect(self.connect_timeout_s)
        return await connection.send(request)

    def close(self) -> None:
        """Close every idle connection (those in use close as their answers end)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _request(authority: str, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    # Made for every request: the values checked all at once, the lines joined in C.
    values = "".join(headers.values())
    if "\r" in values or "\n" in values:
        name = next(name for name, value in headers.items() if "\r" in value or "\n" in value)
        raise UpstreamError(f"header {name} holds a line break")
    fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{fields}\r\n"
    )
    return head.encode("latin-1") + body
