"""The worker's API described as OpenAPI 3.1, generated from the request models (the
same models that validate the requests), served at /openapi.json."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdserve.workers.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "invalid request",
    "404": "unknown model",
    "413": "request body too large",
    "429": "too many requests queued (see Retry-After)",
    "503": "the request waited too long in the queue, or the engine stopped",
}


def openapi_spec(title: str, version: str) -> dict[str, Any]:
    """The OpenAPI document of a worker's HTTP API."""
    bodies: list[type[BaseModel]] = [
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
    ]
    refs, schemas = models_json_schema(
        [(model, "validation") for model in bodies], ref_template="#/components/schemas/{model}"
    )
    components = dict(schemas.get("$defs", {}))
    components["Error"] = _ERROR
    paths = {
        "/v1/completions": _post(refs[(CompletionRequest, "validation")], "Complete a prompt"),
        "/v1/chat/completions": _post(
            refs[(ChatCompletionRequest, "validation")], "Answer a conversation"
        ),
        "/tokenize": _post(
            refs[(TokenizeRequest, "validation")], "Token ids of a prompt or a conversation"
        ),
        "/detokenize": _post(refs[(DetokenizeRequest, "validation")], "Text of token ids"),
        "/v1/models": _get("The served model"),
        "/health": _get("200 while the engine runs"),
        "/ready": _get("200 once the model is loaded and warmed up"),
        "/load": _get("Requests in flight, running and queued, KV cache usage, prefill backlog"),
        "/metrics": _get("Prometheus metrics", "text/plain"),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }


def _post(body_ref: dict[str, Any], summary: str) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    responses: dict[str, Any] = {
        "200": {
            "description": "the answer (JSON), or a stream of server-sent events",
            "content": {"application/json": {}, "text/event-stream": {}},
        }
    }
    responses.update({status: {"description": why, **error} for status, why in _ERRORS.items()})
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": body_ref}},
            },
            "responses": responses,
        }
    }


def _get(summary: str, media: str = "application/json") -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": summary, "content": {media: {}}}},
        }
    }
