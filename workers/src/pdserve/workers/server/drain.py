"""Stopping a worker without failing a request: once told to stop it takes no new
work (503, so the router tries another worker; /ready fails so Kubernetes and the
router stop sending), and waits for the requests in flight and the KV hand-offs it
serves (each is an HTTP request: a completion, or a prefill worker's /pd/prefill)
to end, for at most the drain timeout."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.protocol.api_errors import APIError
from pdserve.workers.kv_wire import FEED_PREFIX

log = logging.getLogger(__name__)

# Requests that are work: completions and the hand-off endpoints. Probes, /metrics,
# /load and /v1/models are answered while draining.
WORK_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/pd/")


class Drain:
    """The requests in flight, and whether the worker is stopping."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def middleware(self) -> Middleware:
        """Counts work in flight; refuses new work while draining."""

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            # A router's read of the KV feed is no work to finish (it waits for events).
            if not request.path.startswith(WORK_PREFIXES) or request.path.startswith(FEED_PREFIX):
                return await handler(request)
            if self.draining:
                raise APIError(
                    503, "the worker is shutting down: send the request to another worker",
                    "server_error", "shutting_down",
                )  # fmt: skip
            self.in_flight += 1
            self._idle.clear()
            try:
                return await handler(request)
            finally:
                self.in_flight -= 1
                if not self.in_flight:
                    self._idle.set()

        return count

    async def drain(self, timeout_s: float) -> int:
        """Refuse new work and wait until none is in flight, or `timeout_s` passed; how
        many requests were still in flight then."""
        self.draining = True
        started = time.monotonic()
        if self.in_flight:
            log.info("draining: %d request(s) in flight", self.in_flight)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("drain timeout: %d request(s) still in flight", self.in_flight)
        else:
            log.info("drained in %.1fs", time.monotonic() - started)
        return self.in_flight
