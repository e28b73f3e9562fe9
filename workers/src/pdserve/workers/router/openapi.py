"""The router's API described as OpenAPI 3.1 (served at /openapi.json): the OpenAI
endpoints as a worker describes them, the router's probes and `/workers`."""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from pdserve.workers.router.workers import WorkersAnswer
from pdserve.workers.server.openapi import OPENAI_ENDPOINTS, Endpoint, openapi_spec, probes

ENDPOINTS = (
    *OPENAI_ENDPOINTS,
    *probes("the router runs"),
    Endpoint("get", "/workers", "The workers discovery found, each one's circuit breaker and "
             "load", WorkersAnswer),
)  # fmt: skip
# The statuses the OpenAI endpoints answer with an error, and why.
ERRORS = {
    400: "invalid request",
    401: "no API key, or a wrong one (a router started with --api-key-file)",
    404: "unknown model",
    413: "request body too large",
    429: "too many requests waiting for their first token, or every worker busy",
    500: "the request failed in the router or a worker",
    502: "the prefill hand-off failed",
    503: "no worker could serve the request (see Retry-After)",
}


@functools.cache
def router_openapi() -> dict[str, Any]:
    """The router's OpenAPI document (made once)."""
    version = importlib.metadata.version("pdserve-workers")
    return openapi_spec("pdserve router", version, ENDPOINTS, ERRORS)
