"""A lean HTTP/1.1 server: an asyncio protocol over httptools' C parser (llhttp), doing
parsing and framing only, under the same network limits as the aiohttp servers.

One handler answers every request (the application routes above it). A request
reaches it with its body received whole; it returns an aiohttp `web.Response` (used
as a container: status, headers, body), sent head and body in one write, or a
`StreamedAnswer` it wrote itself (chunked; its head goes out with its first data).
Requests pipelined on a connection are answered in order; a client that goes away
cancels the handler of its request.

The limits (`NetworkLimits`, `NetworkGuard`), as `connection` and `bodies` enforce
them for aiohttp:
- the head of a request within `--timeout-request-headers` from its first byte (when
  no request is under way on the connection), at most MAX_HEAD_BYTES and MAX_HEADERS:
  else the connection is cut (too large: 431, then closed);
- a body that did not arrive with its head counts among `--limit-body-reads` (503
  past it) and must arrive within `--timeout-request-body` (408); over the body size
  limit, 413 (with Content-Length, before any of it is read);
- a client that takes nothing of its answer for `--timeout-write` is cut off;
- past `--limit-concurrency` open connections, a connection's first request gets 503;
- an idle connection is closed after `--timeout-keep-alive`.
Each refusal answers in OpenAI's error shape and closes its connection."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, NoReturn, TypeAlias, cast

import httptools
import orjson
from aiohttp import web
from multidict import CIMultiDict

from pdserve.protocol.api_errors import APIError, error_body
from pdserve.workers.network.bodies import RETRY_AFTER_S, TOO_MANY_BODY_READS, TOO_MANY_CONNECTIONS
from pdserve.workers.network.guard import NetworkGuard
from pdserve.workers.network.metrics import Refusal

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # a request line and its headers
MAX_HEADERS = 128
# Requests parsed behind the one being answered before the connection stops being read.
MAX_PIPELINED = 16
_CLOSE = {"Connection": "close"}


class Request:
    """One request, its body received whole. `headers` are case-insensitive."""

    __slots__ = (
        "_body",
        "_connection",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "refusal",
        "version",
    )  # fmt: skip

    def __init__(
        self,
        connection: Http1Connection,
        method: str,
        target: str,
        version: str,
        headers: CIMultiDict[str],
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path, _, self.query = target.partition("?")
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive
        self.refusal: APIError | None = None  # answered in place of the handler's answer
        self._body = b""
        self._connection = connection

    @property
    def charset(self) -> str | None:
        """The charset its Content-Type names, if any."""
        for parameter in self.headers.get("Content-Type", "").split(";")[1:]:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "charset":
                return value.strip().strip('"') or None
        return None

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's connection (None once closed)."""
        return self._connection.transport

    @property
    def body(self) -> bytes:
        """The body (what `read` returns, without a coroutine)."""
        return self._body

    async def read(self) -> bytes:
        """The body."""
        return self._body

    def stream(self, headers: Mapping[str, str], status: int = 200) -> StreamedAnswer:
        """Start a streamed answer (nothing is sent before its first write)."""
        return StreamedAnswer(self._connection, self, status, headers)


class StreamedAnswer:
    """An answer written as it is made: chunked (to an HTTP/1.0 client, ended by
    closing the connection). Writes wait while the client's socket is full; they
    raise ConnectionResetError once the client is gone."""

    def __init__(
        self, connection: Http1Connection, request: Request, status: int, headers: Mapping[str, str]
    ) -> None:
        self.status = status
        self.finished = False
        self._connection = connection
        self._chunked = request.version != "1.0"
        framing = {"Transfer-Encoding": "chunked"} if self._chunked else _CLOSE
        if not request.keep_alive:
            framing = {**framing, **_CLOSE}
        self._head: bytes = _head(status, {**headers, **framing})
        if not self._chunked:
            request.keep_alive = False

    def _frame(self, data: bytes) -> bytes:
        head, self._head = self._head, b""
        if not data:
            return head
        if not self._chunked:
            return head + data
        return b"%s%x\r\n%s\r\n" % (head, len(data), data)

    async def write(self, data: bytes) -> None:
        """Send `data` (nothing for empty data), once the client takes it."""
        if data:
            connection = self._connection
            connection.send(self._frame(data))
            if connection.write_paused:  # no coroutine to wait on, as a rule
                await connection.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        """Send `data` and the answer's end, in one write (again: nothing)."""
        if self.finished:
            return
        self.finished = True
        connection = self._connection
        connection.send(self._frame(data) + (b"0\r\n\r\n" if self._chunked else b""))
        if connection.write_paused:
            await connection.drain()


# Declared aliases: where aiohttp is not installed (compiling, see pdserve.workers.compiled)
# its types are Any, and only a declared alias may hold one.
Answer: TypeAlias = web.Response | StreamedAnswer
Handler: TypeAlias = Callable[[Request], Awaitable[Answer]]


class Http1Server:
    """What the connections of one listening socket share: the handler, the network
    guard and the body size limit; and the connections open, to close them."""

    def __init__(self, handler: Handler, guard: NetworkGuard, max_body_size: int) -> None:
        self.handler = handler
        self.guard = guard
        self.max_body_size = max_body_size
        self.connections: set[Http1Connection] = set()
        self._listener: asyncio.Server | None = None

    async def listen(self, host: str, port: int) -> int:
        """Serve on host:port; the port bound (OSError when it cannot be)."""
        loop = asyncio.get_running_loop()
        # Any: uvloop's server lists its sockets where asyncio's types say a tuple (which
        # the compiled module would check).
        listener: Any = await loop.create_server(lambda: Http1Connection(self), host, port)
        self._listener = listener
        return int(listener.sockets[0].getsockname()[1])

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting; let the requests under way end within `grace_s`; close all."""
        if self._listener is not None:
            self._listener.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        # The tasks of idle connections wait for a request that will not come.
        tasks = [c.task for c in self.connections if c.task is not None and c.answering]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for connection in list(self.connections):
            connection.abort()


class Http1Connection(asyncio.Protocol):
    """One client connection: parsing, framing, deadlines."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.guard = server.guard
        self.transport: asyncio.Transport | None = None
        # Answering the queued requests, then waiting for the next: one task for the
        # connection's life (a task per request costs more than the wait).
        self.task: asyncio.Task[None] | None = None
        self._busy = False  # a request is being answered
        self._wakeup: asyncio.Future[None] | None = None  # the task waits for a request
        self.admitted = False
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._queue: deque[Request] = deque()  # parsed, in order; the first is answered
        self._reading = True  # the parser is fed (a refusal stops it for good)
        self._read_paused = False
        self._closing = False  # close once the queue is answered
        # The message being parsed.
        self._begun = False
        self._target = bytearray()
        self._fields: list[bytes] = []  # its header names and values, in turn
        self._head_bytes = 0  # bytes received while its head is incomplete (a bound)
        self._head_size = 0  # its request line and headers, as parsed
        self._current: Request | None = None  # its head complete
        self._body: list[bytes] = []
        self._body_size = 0
        self._body_read = False  # counted among the bodies being read
        # Deadlines, and a writer waiting for the client to take its data.
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        # When the connection last fell idle (None: a request is under way). The idle
        # timer is not re-armed per request: when it fires early it waits the rest.
        self._idle_from: float | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        self._write_paused = False

    # -- the asyncio protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no subclasses of asyncio's, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        self.admitted = self.guard.open_connection()
        if self.admitted:
            self._idle()
        else:  # its request is refused; it is due at once
            self._header_timer = self._later(
                self.guard.limits.timeout_request_headers, self._cut, "header_timeout"
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        for timer in (self._header_timer, self._body_timer, self._idle_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._count_body_read(False)
        if self.admitted:
            self.admitted = False
            self.guard.close_connection()
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client went away"))
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        if not self._reading:
            return
        self._idle_from = None
        if self._current is None:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._reading:
                self._refuse(APIError(400, "protocol upgrades are not supported"))
        except httptools.HttpParserError as error:
            if self._reading:  # else a callback refused the request, and stopped the parser
                self._refuse(APIError(400, f"malformed request: {error}"))
        if not self._reading:
            return
        if self._current is not None:
            if not self._body_read:
                self._start_body_read()
        elif self._begun:
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(_head_too_large())
            elif self._header_timer is None and not self._busy and not self._queue:
                self._start_header_deadline()

    def eof_received(self) -> bool | None:
        return None  # the client is done: close (the request under way is cancelled)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._write_timer = self._later(self.guard.limits.timeout_write, self._cut, "write_timeout")

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- httptools' callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self._reading:
            raise _Stopped
        self._begun = True
        self._head_size = 0

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called for every header of every request: the names and values are decoded,
        # counted and bounded once the head is complete (or when there are many).
        fields = self._fields
        fields += name, value
        if len(fields) > 2 * MAX_HEADERS:
            self._stop(APIError(431, f"the request has over {MAX_HEADERS} header fields"))

    def on_headers_complete(self) -> None:
        parser = self._parser
        fields = self._fields
        # Decoded in one call: llhttp takes no line feed in a header's name or value
        # (it refuses bare ones and folded lines), so one joins them and splits them
        # back apart.
        joined = b"\n".join(fields)
        decoded = joined.decode("latin-1").split("\n") if fields else []
        self._head_size += (len(joined) + 1 + len(fields)) if fields else 0  # ": ", CRLF each
        request = Request(
            self, parser.get_method().decode("ascii", "replace"),
            self._target.decode("latin-1"), parser.get_http_version(),
            # A list: given an iterator, CIMultiDict first asks it for `items` (an
            # AttributeError made and dropped for every request).
            CIMultiDict(list(zip(decoded[::2], decoded[1::2], strict=True))),
            parser.should_keep_alive(),
        )  # fmt: skip
        self._target = bytearray()
        self._fields = []
        self._head_bytes = 0
        self._current = request
        if self._head_size > MAX_HEAD_BYTES:
            self._stop(_head_too_large())
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if not self.admitted:
            self._stop(_busy(
                TOO_MANY_CONNECTIONS,
                f"the server has {self.guard.limits.limit_concurrency} connections open, the "
                "most it takes",
            ))  # fmt: skip
        length = request.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_size:
            self._stop(_too_large(self.server.max_body_size, int(length)))
        if request.headers.get("Expect", "").lower() == "100-continue" and self._answerable():
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.server.max_body_size:
            self._stop(_too_large(self.server.max_body_size, self._body_size))
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = self._current
        if request is None:
            return
        request._body = b"".join(self._body)
        self._body = []
        self._body_size = 0
        self._current = None
        self._begun = False
        self._count_body_read(False)
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._enqueue(request)

    # -- answering ------------------------------------------------------------------------

    def _enqueue(self, request: Request) -> None:
        self._queue.append(request)
        if self.task is None:
            self.task = self._loop.create_task(self._answer_queue())
        elif self._wakeup is not None:
            if not self._wakeup.done():
                self._wakeup.set_result(None)
        elif len(self._queue) > MAX_PIPELINED and not self._read_paused and self.transport:
            self._read_paused = True
            self.transport.pause_reading()

    async def _answer_queue(self) -> None:
        """Answer the queued requests in order; when none is left, wait for the next
        (until the connection closes, or is to close once the queue is answered)."""
        try:
            while self.transport is not None:
                if not self._queue:
                    self._await_next()
                    if self._closing:
                        return
                    self._wakeup = self._loop.create_future()
                    try:
                        await self._wakeup
                    finally:
                        self._wakeup = None
                    continue
                await self._answer(self._queue.popleft())
        except ConnectionResetError:
            self.abort()
        finally:
            self.task = None

    async def _answer(self, request: Request) -> None:
        self._busy = True
        try:
            if request.refusal is not None:
                answer: Answer = _error_answer(request.refusal, _CLOSE)
            else:
                answer = await self._handle(request)
            self._finish(request, answer)
        finally:
            self._busy = False
        if self._read_paused and len(self._queue) <= MAX_PIPELINED and self.transport:
            self._read_paused = False
            self.transport.resume_reading()

    async def _handle(self, request: Request) -> Answer:
        try:
            return await self.server.handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # the handler answers its errors; this is a fault of its own
            log.exception("unexpected error in %s %s", request.method, request.path)
            return _error_answer(APIError(500, "internal server error", "server_error"), {})

    def _finish(self, request: Request, answer: Answer) -> None:
        """Send a whole answer; end a streamed one its handler left open; close the
        connection when either side said so."""
        if isinstance(answer, StreamedAnswer):
            if not answer.finished:
                answer.finished = True
                self.send(answer._frame(b"") + (b"0\r\n\r\n" if answer._chunked else b""))
        else:
            if "close" in answer.headers.get("Connection", "").lower():
                request.keep_alive = False
            elif not request.keep_alive:
                answer.headers["Connection"] = "close"
            self.send(_whole(answer, head_only=request.method == "HEAD"))
        if not request.keep_alive or request.refusal is not None:
            self._closing = True
            self._queue.clear()
            if self.transport is not None:
                self.transport.close()  # once what was written is sent

    def _await_next(self) -> None:
        """The queue is answered: wait for the next request (its head, if begun)."""
        if self.transport is None or self._closing:
            return
        if self._begun and self._current is None:
            self._start_header_deadline()
        elif not self._begun:
            self._idle()

    @property
    def answering(self) -> bool:
        """Whether a request is being answered or waits to be."""
        return self._busy or bool(self._queue)

    def _answerable(self) -> bool:
        return not self.answering

    def send(self, data: bytes) -> None:
        """Write to the client (ConnectionResetError once it is gone)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(data)

    @property
    def write_paused(self) -> bool:
        """Whether the client's socket is full (`drain` waits for it)."""
        return self._write_paused

    async def drain(self) -> None:
        """Wait until the client's socket takes data again (it was full)."""
        if not self._write_paused:
            return
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()
        await self._drained

    def close_when_idle(self) -> None:
        """Close now if nothing is under way, else once the requests under way are answered."""
        self._closing = True
        self._reading = False
        if self._answerable() and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection now."""
        if self.transport is not None:
            self.transport.abort()

    # -- limits -------------------------------------------------------------------------

    def _stop(self, error: APIError) -> NoReturn:
        """Refuse the request being parsed (from a parser callback) and stop parsing."""
        self._refuse(error)
        raise _Stopped

    def _refuse(self, error: APIError) -> None:
        """Answer `error` in place of the request being parsed (after those before it)
        and close: nothing more is read from this connection."""
        self._reading = False
        self._count_body_read(False)
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None
        request = self._current or Request(self, "GET", "/", "1.1", CIMultiDict(), False)
        request.refusal = error
        self._current = None
        if self.transport is not None:
            self.transport.pause_reading()
        self._enqueue(request)

    def _start_body_read(self) -> None:
        """The request's head came without all its body: it is one of the bodies being read."""
        limits = self.guard.limits
        if self.guard.body_reads >= limits.limit_body_reads:
            self.guard.metrics.refused("body_read_limit")
            self._refuse(_busy(
                TOO_MANY_BODY_READS,
                f"the server is receiving {limits.limit_body_reads} request bodies, the most "
                "it takes at once",
            ))  # fmt: skip
            return
        self._count_body_read(True)
        self._body_timer = self._later(limits.timeout_request_body, self._body_out)

    def _count_body_read(self, reading: bool) -> None:
        if reading != self._body_read:
            self._body_read = reading
            self.guard.body_reads += 1 if reading else -1

    def _body_out(self) -> None:
        self._body_timer = None
        self.guard.metrics.refused("body_timeout")
        timeout = self.guard.limits.timeout_request_body
        self._refuse(APIError(
            408, f"the request body did not arrive within {timeout:g} s", code="body_timeout",
        ))  # fmt: skip

    def _start_header_deadline(self) -> None:
        self._header_timer = self._later(
            self.guard.limits.timeout_request_headers, self._cut, "header_timeout"
        )

    def _idle(self) -> None:
        """The connection fell idle: closed if no request comes within the keep-alive
        timeout."""
        self._idle_from = self._loop.time()
        if self._idle_timer is None:
            self._idle_timer = self._later(self.guard.limits.timeout_keep_alive, self._idle_out)

    def _idle_out(self) -> None:
        self._idle_timer = None
        if self._idle_from is None:
            return  # a request came: the timer is armed again when it falls idle
        left = self._idle_from + self.guard.limits.timeout_keep_alive - self._loop.time()
        if left > 0:  # it fell idle again since the timer was armed
            self._idle_timer = self._later(left, self._idle_out)
            return
        if self._answerable() and not self._begun:
            self.abort()

    def _cut(self, reason: Refusal) -> None:
        """Drop the connection now, with whatever it still had to send."""
        self._header_timer = self._write_timer = None
        self.guard.metrics.refused(reason)
        log.debug("a client connection was cut off: %s", reason)
        self.abort()

    def _later(
        self, delay: float, callback: Callable[..., None], *args: object
    ) -> asyncio.TimerHandle:
        return self._loop.call_later(delay, callback, *args)


class _Stopped(Exception):
    """Raised in a parser callback to stop parsing a refused request."""


def _busy(code: str, why: str) -> APIError:
    return APIError(
        503, f"{why}: retry later", "server_error", code,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )  # fmt: skip


def _head_too_large() -> APIError:
    return APIError(431, f"the request's head is over {MAX_HEAD_BYTES} bytes")


def _too_large(limit: int, size: int) -> APIError:
    return APIError(413, f"Maximum request body size {limit} exceeded, actual body size {size}")


def _error_answer(error: APIError, headers: Mapping[str, str]) -> web.Response:
    body = orjson.dumps(error_body(str(error), error.kind, error.code))
    return web.Response(
        body=body, status=error.status,
        headers={"Content-Type": "application/json", **error.headers, **headers},
    )  # fmt: skip


# The reason phrase of each status, looked up once (an answer's head is made for every
# request).
_REASONS = {status.value: status.phrase for status in HTTPStatus}


def _reason(status: int) -> str:
    return _REASONS.get(status, "")


def _head(status: int, headers: Mapping[str, str]) -> bytes:
    # Made for every answer: the values checked all at once, the lines joined in C.
    values = "".join(headers.values())
    if "\r" in values or "\n" in values:
        name = next(name for name, value in headers.items() if "\r" in value or "\n" in value)
        raise ValueError(f"header {name} holds a line break")
    fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    return f"HTTP/1.1 {status} {_reason(status)}\r\n{fields}\r\n".encode("latin-1")


def _whole(answer: web.Response, head_only: bool) -> bytes:
    """An answer sent whole: its head (Content-Length framed) and body, one buffer."""
    body = answer.body
    data = body if isinstance(body, bytes) else b""
    headers = {
        "Content-Type": "application/octet-stream",
        **answer.headers,
        "Content-Length": str(len(data)),
    }
    head = _head(answer.status, headers)
    return head if head_only else head + data
