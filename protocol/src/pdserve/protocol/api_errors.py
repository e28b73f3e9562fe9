"""Errors answered over HTTP in OpenAI's error shape, and the one place that turns
them, and anything else a handler raises, into answers. The worker's OpenAI
endpoints, the hand-off's `/pd/*` endpoints and the router all use it.

A handler raises `APIError(status, message, ...)`; `error_middleware` answers it.
aiohttp's own errors (no such route, wrong method, body too large) get the same
shape, with their headers (a 405 names the allowed methods in `Allow`), and an
unexpected exception is logged with its traceback and answered 500 without one. A
client that goes away mid-answer is no error: it is logged as what it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import BaseModel, Field, ValidationError

from pdserve.protocol.headers import REQUEST_ID_HEADER

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)

# The code of a 500 for a request that failed alone in a worker's engine: the worker
# goes on serving, and the request would fail anywhere, so the router does not retry it.
REQUEST_FAILED = "request_failed"


class ClientRequest(Protocol):
    """What answering a request needs of it: aiohttp's `web.Request` and the router's
    own server's requests both have it."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def charset(self) -> str | None: ...

    @property
    def transport(self) -> asyncio.BaseTransport | None: ...

    async def read(self) -> bytes: ...


class ErrorDetail(BaseModel):
    """What went wrong, in OpenAI's shape."""

    message: str
    type: str = Field(description="invalid_request_error, server_error, ...")
    param: str | None
    code: str | None = Field(description="a short machine-readable cause, when there is one")


class ErrorResponse(BaseModel):
    """Every error answer (and a stream's error event), in OpenAI's shape."""

    error: ErrorDetail


class APIError(Exception):
    """An error answered with `status` and an OpenAI-style body. `kind` is the body's
    `type` (invalid_request_error, server_error, ...), `code` a short machine-readable
    cause (None: none more precise than the status)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code
        self.headers = headers or {}


def error_body(message: str, kind: str, code: str | None) -> dict[str, Any]:
    """OpenAI's error body."""
    detail = ErrorDetail(message=message, type=kind, param=None, code=code)
    return ErrorResponse(error=detail).model_dump()


def error_response(error: APIError) -> web.Response:
    """The answer for `error`."""
    body = error_body(str(error), error.kind, error.code)
    return web.json_response(body, status=error.status, headers=error.headers)


def error_middleware(on_error: Callable[[APIError], None] | None = None) -> Middleware:
    """The middleware that answers every error in OpenAI's shape; `on_error` is told
    of each one (for metrics)."""

    @web.middleware
    async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as error:
            failure = error
        except web.HTTPException as error:
            if error.status < 400:
                raise
            failure = _from_aiohttp(request, error)
        except asyncio.CancelledError:
            if client_gone(request):
                log_client_gone(request)
            raise
        except Exception as error:
            found = failure_of(request, error)
            if found is None:
                return web.Response(status=499)  # nobody reads it: aiohttp closes the connection
            failure = found
        if on_error is not None:
            on_error(failure)
        return error_response(failure)

    return answer_errors


def failure_of(request: ClientRequest, error: Exception) -> APIError | None:
    """The error to answer for what a handler of `request` raised (call it in the
    `except` block): an APIError as it is, anything unexpected as a 500 (logged with
    its traceback); None for a client that went away (logged as such: no answer)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ConnectionResetError) and client_gone(request):
        log_client_gone(request)
        return None
    log.exception("unexpected error in %s %s", request.method, request.path)
    return APIError(500, "internal server error", "server_error")


def _from_aiohttp(request: web.Request, error: web.HTTPException) -> APIError:
    """aiohttp's own refusal in OpenAI's shape, keeping the headers it sets."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    message = error.reason
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        message = f"{error.method} is not allowed on {request.path} (allowed: {allowed})"
    headers = {
        name: value
        for name, value in error.headers.items()
        if name.lower() not in ("content-type", "content-length")
    }
    return APIError(error.status, message, kind, headers=headers)


def client_gone(request: ClientRequest) -> bool:
    """Whether the client's connection is closed (or closing)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def log_client_gone(request: ClientRequest) -> None:
    """A client that hung up before its answer was complete: an ordinary event."""
    client_id = request.headers.get(REQUEST_ID_HEADER, "")[:256]
    named = f" ({REQUEST_ID_HEADER} {client_id})" if client_id else ""
    log.info("%s %s%s: the client went away", request.method, request.path, named)


def validation_message(error: ValidationError) -> str:
    """One line naming each invalid field and why."""
    parts = []
    for item in error.errors():
        field = ".".join(str(piece) for piece in item["loc"]) or "body"
        parts.append(f"{field}: {item['msg']}")
    return "; ".join(parts)


# Bodies larger than this are parsed on a thread, so the event loop (and the probes
# it answers) keeps running while a large prompt is decoded.
_PARSE_INLINE_BYTES = 64 * 1024


async def read_body(request: ClientRequest, model: type[Body], what: str = "request") -> Body:
    """The request's JSON body validated as `model`; a 400 naming the problem when it is
    not UTF-8 JSON, not an object, or not valid. (A body over the application's
    `client_max_size` is a 413, from aiohttp.)"""
    charset = request.charset
    if charset is not None and charset.lower().replace("-", "") != "utf8":
        raise APIError(400, f"unsupported charset {charset!r}: JSON bodies must be UTF-8")
    data = await request.read()
    if len(data) > _PARSE_INLINE_BYTES:
        raw = await asyncio.to_thread(parse_json, data)
    else:
        raw = parse_json(data)
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise APIError(400, f"invalid {what}: {validation_message(error)}") from error


def parse_json(data: bytes) -> Any:
    """JSON from UTF-8 bytes; a 400 for anything that is not JSON in valid Unicode
    (malformed, nested too deep for the parser, or holding a lone surrogate escape
    such as "\\ud800", which no UTF-8 text can carry)."""
    try:
        # orjson takes only valid JSON in valid UTF-8 (no lone surrogate, escaped or
        # not), in one pass over the bytes.
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass  # the standard library's parser takes NaN and Infinity, or names the fault
    try:
        raw = json.loads(data.decode("utf-8"))
        json.dumps(raw, ensure_ascii=False).encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as error:
        raise APIError(400, f"the body is not valid Unicode: {error.reason}") from error
    except json.JSONDecodeError as error:
        raise APIError(400, f"malformed JSON body: {error}") from error
    except RecursionError as error:
        raise APIError(400, "the JSON body is nested too deeply") from error
    return raw
