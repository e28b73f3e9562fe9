"""The router's API described as OpenAPI 3.1 (served at /openapi.json): the OpenAI
endpoints as a worker describes them, the router's probes and `/workers`."""

from __future__ import annotations

import functools
from typing import Any

from pdserve.protocol.openapi import (
    OPENAI_ENDPOINTS,
    OPENAI_ERRORS,
    Endpoint,
    openapi_spec,
    probes,
)
from pdserve.workers.router.workers import WorkersAnswer

ENDPOINTS = (
    *OPENAI_ENDPOINTS,
    *probes("the router runs"),
    Endpoint("get", "/workers", "The workers discovery found, each one's circuit breaker and "
             "load", WorkersAnswer),
)  # fmt: skip
ERRORS = {
    **OPENAI_ERRORS,
    401: "no API key, or a wrong one (a router started with --api-key-file)",
    429: "too many requests waiting for their first token, or every worker busy",
    503: "no worker could serve the request (see Retry-After)",
}


@functools.cache
def router_openapi() -> dict[str, Any]:
    """The router's OpenAPI document (made once)."""
    return openapi_spec("pdserve router", ENDPOINTS, ERRORS)
