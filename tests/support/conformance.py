"""Checking a server's answers as a third-party client would: against the response
schemas the server publishes at /openapi.json (JSON Schema 2020-12, with jsonschema)
and with the `openai` client's own models, strictly."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import aiohttp
import jsonschema
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

# Where OpenAI's API sends null but the openai client's models say otherwise (the
# client builds streamed objects without validating them): a completion chunk's
# finish_reason before its choice ends, and an echoed prompt's first token, which has
# no log-probability. Only these, with null in them, may fail the models.
_UNTYPED_NULLS = {
    "chunk": re.compile(r"choices\.\d+\.finish_reason"),
    "echo": re.compile(r"choices\.\d+\.logprobs\.(token_logprobs|top_logprobs)\.0"),
}


class PublishedApi:
    """A server's /openapi.json, to validate its answers with."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def schema(self, method: str, path: str, status: int, media: str) -> dict[str, Any]:
        """The published schema of an answer (an operation's `default` for a status it
        does not list)."""
        responses = self.spec["paths"][path][method.lower()]["responses"]
        response = responses.get(str(status), responses["default"])
        schema: dict[str, Any] = response["content"][media]["schema"]
        assert schema, f"{method} {path} {status} {media}: an empty schema"
        return schema

    def check(self, method: str, path: str, status: int, media: str, body: Any) -> None:
        """Raise jsonschema's ValidationError unless `body` follows the schema of the
        operation's answer, or for an operation not published, the error schema."""
        operation = self.spec["paths"].get(path, {}).get(method.lower())
        if operation is None:
            self.validate({"$ref": "#/components/schemas/ErrorResponse"}, body)
        else:
            self.validate(self.schema(method, path, status, media), body)

    def validate(self, schema: dict[str, Any], body: Any) -> None:
        """Raise jsonschema's ValidationError unless `body` follows `schema` (whose
        references point into the document's components)."""
        rooted = {**schema, "components": self.spec["components"]}
        jsonschema.Draft202012Validator(rooted).validate(body)


def openai_misfits(
    model: type[BaseModel], body: Any, allowed: Iterable[str] = ()
) -> list[ErrorDetails]:
    """Where `body` fails `model` (an openai client model, validated strictly), beyond
    the nulls `allowed` names ("chunk", "echo")."""
    try:
        model.model_validate(body, strict=True)
    except ValidationError as error:
        patterns = [_UNTYPED_NULLS[name] for name in allowed]
        return [
            item
            for item in error.errors()
            if not (
                item["input"] is None
                and any(p.fullmatch(".".join(map(str, item["loc"]))) for p in patterns)
            )
        ]
    return []


async def events(answer: aiohttp.ClientResponse) -> list[Any]:
    """The JSON of every `data:` event of an SSE answer, and "[DONE]" as such."""
    found: list[Any] = []
    async for line in answer.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        found.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return found
