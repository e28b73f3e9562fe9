"""The middleware of the network limits: a request on a connection that was not
admitted gets 503, and a request body is received before the handler runs, within
`--timeout-request-body` (else 408) and among at most `--limit-body-reads` bodies at
once (else 503). Each refusal closes its connection once answered.

A body that arrived whole with its headers (as small ones do) takes no place among
the bodies being read; a larger one (over aiohttp's read buffer) or a slow one does,
for as long as it takes to arrive. The handler then reads the body from memory."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.protocol.api_errors import APIError
from pdserve.workers.network.connection import GuardedRequestHandler
from pdserve.workers.network.guard import NetworkGuard

RETRY_AFTER_S = 1
# The error codes of the refusals that mean "busy, retry": a router retries them on
# another worker without holding them against this one.
TOO_MANY_CONNECTIONS = "too_many_connections"
TOO_MANY_BODY_READS = "too_many_body_reads"
BUSY_CODES = frozenset({TOO_MANY_CONNECTIONS, TOO_MANY_BODY_READS})


def guard_middleware(guard: NetworkGuard) -> Middleware:
    """The middleware of `guard` (innermost: requests refused for other reasons, such
    as a missing key, are refused before their bodies are read)."""

    @web.middleware
    async def guard_request(request: web.Request, handler: Handler) -> web.StreamResponse:
        protocol = request.protocol
        connection = protocol if isinstance(protocol, GuardedRequestHandler) else None
        if connection is not None and not connection.admitted:
            raise _busy(
                connection, TOO_MANY_CONNECTIONS,
                f"the server has {guard.limits.limit_concurrency} connections open, the most "
                "it takes",
            )  # fmt: skip
        if not request.content.is_eof():
            await _receive_body(guard, request, connection)
        return await handler(request)

    return guard_request


async def _receive_body(
    guard: NetworkGuard, request: web.Request, connection: GuardedRequestHandler | None
) -> None:
    """Read the whole body into the request (413 past --max-body-size, from aiohttp)."""
    limits = guard.limits
    if guard.body_reads >= limits.limit_body_reads:
        guard.metrics.refused("body_read_limit")
        raise _busy(
            connection, TOO_MANY_BODY_READS,
            f"the server is receiving {limits.limit_body_reads} request bodies, the most it "
            "takes at once",
        )  # fmt: skip
    guard.body_reads += 1
    try:
        async with asyncio.timeout(limits.timeout_request_body):
            await request.read()
    except TimeoutError:
        guard.metrics.refused("body_timeout")
        _close_after_answer(connection)
        raise APIError(
            408, f"the request body did not arrive within {limits.timeout_request_body:g} s",
            code="body_timeout", headers={"Connection": "close"},
        ) from None  # fmt: skip
    finally:
        guard.body_reads -= 1


def _busy(connection: GuardedRequestHandler | None, code: str, why: str) -> APIError:
    """The 503 of a cap, its connection closed once answered."""
    _close_after_answer(connection)
    return APIError(
        503, f"{why}: retry later", "server_error", code,
        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
    )  # fmt: skip


def _close_after_answer(connection: GuardedRequestHandler | None) -> None:
    if connection is not None:
        connection.close_after_response = True
