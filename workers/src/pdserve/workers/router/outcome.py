"""The one outcome of each routed request, in `pdserve_router_requests_total`.

A request is counted in `pdserve_router_decisions_total` when the routing table has
chosen its path, and under exactly one outcome when it ends, however it ends: `ok`
(answered), `error` (no worker could answer, or the worker's answer failed),
`invalid` (a worker refused it as the client's fault) or `cancelled` (the client went
away first: before the answer's headers, before its first token or mid-stream). Both
counts are made by `counted`, around the whole of a request's serving, so that no way
out of it (a return, an error, a cancel) goes uncounted.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Literal

from pdserve.protocol.api_errors import APIError
from pdserve.workers.network.http1 import Answer
from pdserve.workers.router.metrics import RouterMetrics
from pdserve.workers.router.routed import Routed
from pdserve.workers.router.sse import TokenStream

Outcome = Literal["ok", "error", "invalid", "cancelled"]


class RequestOutcome:
    """What became of one routed request, filled in as it is served."""

    def __init__(self, mode: str) -> None:
        self.mode = mode  # as served: the plan's, then the worker's answer's
        self.stream: TokenStream | None = None  # the stream relayed, once it has begun
        self.output_tokens: int | None = None  # per choice, of an answer sent whole
        self.outcome: Outcome | None = None
        self.revisions = ("", "")  # the prefill and decode workers' revisions, as served

    def ended(self, outcome: Outcome) -> None:
        """The request ended with `outcome`."""
        self.outcome = outcome

    def answered(self, response: Answer) -> Answer:
        """The request ended with `response` (its status says how, unless the relay
        already said so); returns it."""
        if self.outcome is None:
            self.outcome = outcome_of(response.status)
        return response

    def cancelled(self) -> None:
        """The client went away. One that hung up once it had read the end of its
        stream (clients do, before the worker's stream closes) got the whole answer."""
        stream = self.stream
        if stream is not None and stream.done:
            self.outcome = "ok" if stream.error is None else "error"
        else:
            self.outcome = "cancelled"

    def failed(self, error: BaseException) -> None:
        """The request ended with `error` raised."""
        if isinstance(error, asyncio.CancelledError | ConnectionResetError):
            self.cancelled()
        elif isinstance(error, APIError):
            self.outcome = outcome_of(error.status)
        else:
            self.outcome = "error"


def outcome_of(status: int) -> Outcome:
    """The outcome of an answer with HTTP `status`."""
    if status == 200:
        return "ok"
    if 400 <= status < 500 and status != 429:
        return "invalid"
    return "error"


def counted(metrics: RouterMetrics, routed: Routed) -> Counted:
    """Count the routing decision now, and the request's one outcome when the block
    ends, however it ends (an outcome nobody set is an error's)."""
    metrics.decided(routed.bucket, routed.mode)
    return Counted(metrics, routed)


class Counted:
    """The block of one request's serving (see `counted`); a class rather than a
    generator, as it wraps every request."""

    __slots__ = ("_metrics", "_routed", "record")

    def __init__(self, metrics: RouterMetrics, routed: Routed) -> None:
        self._metrics = metrics
        self._routed = routed
        self.record = RequestOutcome(routed.mode)

    def __enter__(self) -> RequestOutcome:
        return self.record

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        record, routed = self.record, self._routed
        if error is not None and record.outcome is None:
            record.failed(error)
        streams = record.stream.streams if record.stream is not None else ()
        self._metrics.observe_request(
            routed.bucket, record.mode, record.outcome or "error", routed.arrival, streams,
            time.monotonic(), routed.slo, record.output_tokens, record.revisions,
        )  # fmt: skip
