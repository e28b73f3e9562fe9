"""A server's API described as OpenAPI 3.1, served at /openapi.json by a worker and by
the router: the request bodies' schemas from the models that validate them
(`protocol`), the answers' from the models that build them (`response_models`,
`api_errors`), so a schema-checking client validates every answer against what the
code sends. A streamed answer is `text/event-stream`: each `data:` event holds one
chunk (or, when the stream fails, an error), and `data: [DONE]` ends it."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from pdserve.protocol.api_errors import ErrorResponse
from pdserve.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pdserve.protocol.response_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    DetokenizeAnswer,
    ModelList,
    ProbeAnswer,
    TokenizeAnswer,
)

_REF = "#/components/schemas/{model}"
_ERROR_REF = {"$ref": _REF.format(model=ErrorResponse.__name__)}


@dataclass(frozen=True)
class QueryParameter:
    """A query parameter of an operation, its JSON Schema and meaning."""

    name: str
    description: str
    schema: Mapping[str, Any]


# The pool's internal credential, presented as a bearer token.
POOL_CREDENTIAL = "poolCredential"


@dataclass(frozen=True)
class Endpoint:
    """One operation: its body's model, its answer's (JSON, or text for `media`), the
    model of its stream's events, and what its 503 answers with; its query
    parameters, the errors it answers with (besides the OpenAI endpoints' own), and
    whether it needs the pool's credential."""

    method: Literal["get", "post"]
    path: str
    summary: str
    answer: Any  # a type pydantic can describe, or None for text
    request: Any = None
    stream: Any = None
    media: str = "application/json"
    unavailable: Any = None  # the body of a 503 that is not an error (a probe's)
    parameters: tuple[QueryParameter, ...] = ()
    errors: tuple[tuple[int, str], ...] = ()
    internal: bool = False  # only for holders of the pool's credential


OPENAI_ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("post", "/v1/completions", "Complete a prompt", Completion, CompletionRequest,
             CompletionChunk),
    Endpoint("post", "/v1/chat/completions", "Answer a conversation", ChatCompletion,
             ChatCompletionRequest, ChatCompletionChunk),
    Endpoint("post", "/tokenize", "Token ids of a prompt or a conversation", TokenizeAnswer,
             TokenizeRequest),
    Endpoint("post", "/detokenize", "Text of token ids", DetokenizeAnswer, DetokenizeRequest),
    Endpoint("get", "/v1/models", "The served model", ModelList),
)  # fmt: skip


def probes(serving: str) -> tuple[Endpoint, ...]:
    """/health, /ready, /metrics and /openapi.json; `serving`: what /health watches."""
    return (
        Endpoint("get", "/health", f"200 while {serving}", ProbeAnswer, unavailable=ProbeAnswer),
        Endpoint("get", "/ready", "200 while ready to serve", ProbeAnswer, unavailable=ProbeAnswer),
        Endpoint("get", "/metrics", "Prometheus metrics", None, media="text/plain"),
        Endpoint("get", "/openapi.json", "This document", dict[str, Any]),
    )


# The statuses the OpenAI endpoints of either server answer with an error, and why.
OPENAI_ERRORS = {
    400: "invalid request",
    404: "unknown model",
    413: "request body too large",
    500: "the request failed in the server",
    502: "the prefill hand-off failed",
}


def openapi_spec(
    title: str, endpoints: Sequence[Endpoint], errors: Mapping[int, str]
) -> dict[str, Any]:
    """The OpenAPI document of `endpoints`; `errors`: the statuses the OpenAI endpoints
    answer with an error, and why (any other error has the same shape)."""
    version = importlib.metadata.version("pdserve-protocol")
    refs, components = _schemas(endpoints)
    paths: dict[str, Any] = {}
    for endpoint in endpoints:
        operation = _operation(endpoint, refs, errors)
        paths.setdefault(endpoint.path, {})[endpoint.method] = operation
    security = {
        POOL_CREDENTIAL: {
            "type": "http", "scheme": "bearer",
            "description": "the pool's internal credential (a Secret in Kubernetes)",
        }
    }  # fmt: skip
    found: dict[str, Any] = {"schemas": components}
    if any(endpoint.internal for endpoint in endpoints):
        found["securitySchemes"] = security
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": found,
    }


def _schemas(endpoints: Sequence[Endpoint]) -> tuple[dict[Any, Any], dict[str, Any]]:
    """Each model's schema (a $ref, or inline for a plain type) and the named
    definitions, generated in one pass so shared models are defined once."""
    wanted: dict[tuple[Any, JsonSchemaMode], None] = {(ErrorResponse, "serialization"): None}
    for endpoint in endpoints:
        if endpoint.request is not None:
            wanted[endpoint.request, "validation"] = None
        for answer in (endpoint.answer, endpoint.stream, endpoint.unavailable):
            if answer is not None:
                wanted[answer, "serialization"] = None
    generator = GenerateJsonSchema(ref_template=_REF)
    inputs = [(kind, mode, TypeAdapter(kind).core_schema) for kind, mode in wanted]
    refs, definitions = generator.generate_definitions(inputs)
    named = {str(name): schema for name, schema in definitions.items()}
    return {kind: schema for (kind, _), schema in refs.items()}, named


def _operation(
    endpoint: Endpoint, refs: Mapping[Any, Any], errors: Mapping[int, str]
) -> dict[str, Any]:
    content: dict[str, Any] = {endpoint.media: {"schema": _schema(endpoint.answer, refs)}}
    if endpoint.stream is not None:
        content["text/event-stream"] = {"schema": {"oneOf": [refs[endpoint.stream], _ERROR_REF]}}
    described = endpoint.summary
    if endpoint.stream is not None:
        described = "the answer (JSON), or with `stream`, server-sent events"
    responses: dict[str, Any] = {"200": {"description": described, "content": content}}
    if endpoint.unavailable is not None:
        schema = {"schema": refs[endpoint.unavailable]}
        responses["503"] = {
            "description": "not now (`status` says why)",
            "content": {endpoint.media: schema},
        }
    elif endpoint.request is not None:
        for status, why in errors.items():
            responses[str(status)] = _error(why)
    for status, why in endpoint.errors:
        responses[str(status)] = _error(why)
    responses["default"] = _error("an error, in OpenAI's shape")
    operation: dict[str, Any] = {"summary": endpoint.summary, "responses": responses}
    if endpoint.parameters:
        operation["parameters"] = [
            {"name": p.name, "in": "query", "description": p.description, "schema": p.schema}
            for p in endpoint.parameters
        ]
    if endpoint.internal:
        operation["security"] = [{POOL_CREDENTIAL: []}]
    if endpoint.request is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[endpoint.request]}},
        }
    return operation


def _schema(kind: Any, refs: Mapping[Any, Any]) -> dict[str, Any]:
    if kind is None:
        return {"type": "string"}
    schema: dict[str, Any] = refs[kind]
    return schema


def _error(why: str) -> dict[str, Any]:
    return {"description": why, "content": {"application/json": {"schema": _ERROR_REF}}}
