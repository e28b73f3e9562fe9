"""aiohttp's HTTP/1 protocol with the deadlines it lacks.

aiohttp closes a connection that sent nothing for its keep-alive time, but gives a
request's headers as long as they take and a client that stops reading its answer
forever. This subclass of its `RequestHandler` adds, per connection:

- a header deadline: from the first byte of a request that arrives while the
  connection has no request under way, its headers must be complete within
  `--timeout-request-headers`, or the connection is closed (bytes pipelined behind a
  request under way are bounded by the keep-alive timeout, which starts when it ends);
- a write deadline: while the connection's send buffer is full (the transport paused
  writing: the client takes nothing), for at most `--timeout-write`; then the
  connection is dropped with what it held, and the request it served is cancelled;
- admission: past `--limit-concurrency` open connections a new one is not admitted;
  its first request is answered 503 (by the `bodies` middleware), and its headers are
  due within the header deadline from the moment it opened.

It reads two counters of its base class (requests parsed on the connection, and the
event loop); `finish_response` and the asyncio protocol callbacks it extends are
aiohttp's interface to subclasses."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from pdserve.workers.network.guard import NetworkGuard
from pdserve.workers.network.metrics import Refusal

log = logging.getLogger(__name__)


class GuardedRequestHandler(RequestHandler):
    """One client connection, under the guard's deadlines and caps."""

    def __init__(self, manager: web.Server, guard: NetworkGuard, **kwargs: Any) -> None:
        super().__init__(manager, keepalive_timeout=guard.limits.timeout_keep_alive, **kwargs)
        self.guard = guard
        self.admitted = False
        # Set by a refusal answered on this connection: close it once the answer is out
        # rather than read on (aiohttp would read the rest of the body for a while).
        self.close_after_response = False
        self._answered = 0  # requests of this connection answered (cf. _request_count)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None

    # -- the asyncio protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.admitted = self.guard.open_connection()
        super().connection_made(transport)
        if not self.admitted:
            self._start_header_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel(self._header_deadline)
        self._cancel(self._write_deadline)
        self._header_deadline = self._write_deadline = None
        if self.admitted:
            self.admitted = False
            self.guard.close_connection()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        idle = self._request_count == self._answered
        parsed = self._request_count
        super().data_received(data)
        if self._request_count > parsed:  # a request's headers are complete
            self._cancel(self._header_deadline)
            self._header_deadline = None
        elif data and idle and self._header_deadline is None:
            self._start_header_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_deadline = self._loop.call_later(
            self.guard.limits.timeout_write, self._cut, "write_timeout"
        )

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._write_deadline)
        self._write_deadline = None

    # -- aiohttp's request cycle -------------------------------------------------------

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._answered += 1
            if self.close_after_response:
                self.force_close()  # the answer is flushed first

    # -- deadlines ---------------------------------------------------------------------

    def _start_header_deadline(self) -> None:
        self._header_deadline = self._loop.call_later(
            self.guard.limits.timeout_request_headers, self._cut, "header_timeout"
        )

    def _cut(self, reason: Refusal) -> None:
        """Drop the connection now, with whatever it still had to send."""
        self._header_deadline = self._write_deadline = None
        self.guard.metrics.refused(reason)
        log.debug("connection from %s cut off: %s", self.peername, reason)
        transport = self.transport
        self.force_close()
        if transport is not None:
            transport.abort()

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()
