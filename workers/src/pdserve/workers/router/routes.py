"""The router's routes on its HTTP/1.1 server: each path's method and handler, the
client's API key where one is needed, and every error answered in OpenAI's shape (for
the router, what aiohttp's URL dispatcher and `api_errors.error_middleware` do for
the worker: 404, 405 with `Allow`, a 500 without a traceback, a client that went away
logged as what it is)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from pdserve.protocol.api_errors import (
    APIError,
    client_gone,
    error_response,
    failure_of,
    log_client_gone,
)
from pdserve.workers.network.http1 import Answer, Request
from pdserve.workers.router.auth import PROTECTED_PREFIXES, ApiKeys

Handler = Callable[[Request], Awaitable[Answer]]


class Routes:
    """Paths to handlers; an instance is the server's one handler."""

    def __init__(self, api_keys: ApiKeys, on_error: Callable[[APIError], None]) -> None:
        self._api_keys = api_keys
        self._on_error = on_error
        self._table: dict[str, tuple[str, Handler]] = {}

    def post(self, path: str, handler: Handler) -> None:
        """POST `path` to `handler`."""
        self._table[path] = ("POST", handler)

    def get(self, path: str, handler: Handler) -> None:
        """GET (and HEAD) `path` to `handler`."""
        self._table[path] = ("GET", handler)

    async def __call__(self, request: Request) -> Answer:
        try:
            return await self._dispatch(request)
        except asyncio.CancelledError:
            if client_gone(request):
                log_client_gone(request)
            raise
        except Exception as error:
            failure = failure_of(request, error)
            if failure is None:
                raise  # nobody reads an answer: the server closes the connection
        self._on_error(failure)
        return error_response(failure)

    async def _dispatch(self, request: Request) -> Answer:
        path = request.path
        if self._api_keys.path is not None and path.startswith(PROTECTED_PREFIXES):
            self._api_keys.check(request)
        route = self._table.get(path)
        if route is None:
            raise APIError(404, "Not Found")
        method, handler = route
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            allowed = "GET,HEAD" if method == "GET" else method
            raise APIError(
                405, f"{request.method} is not allowed on {path} (allowed: {allowed})",
                headers={"Allow": allowed},
            )  # fmt: skip
        return await handler(request)
