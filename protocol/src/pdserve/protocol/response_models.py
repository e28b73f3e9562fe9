"""The bodies a worker and the router answer with, as pydantic models in OpenAI's (and,
for `/tokenize` and `/detokenize`, vLLM's) shapes. Every answer is built through its
model, and `/openapi.json` publishes the same models' schemas, so what a
schema-checking client validates against is what the code sends.

`model` in an answer is the name the client asked for (the served name when it named
none), as vLLM does. Fields that are extensions (`token_ids`) or that OpenAI sends only
sometimes (a chunk's `usage`, `max_model_len`, a probe's `role`) are left out rather
than sent as null when they hold nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length"]


def _absent(value: Any) -> bool:
    return value is None


def _optional(description: str) -> Any:
    """A field left out of the answer (not null) when it holds nothing."""
    return Field(default=None, exclude_if=_absent, description=description)


TokenIds = Annotated[
    list[int] | None, _optional("the choice's token ids (asked for with return_token_ids)")
]


class _Body(BaseModel):
    """An answer: built from values the server made, so nothing is coerced."""

    model_config = ConfigDict(strict=True)


class PromptTokensDetails(_Body):
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# -- completions ------------------------------------------------------------------------


class TextLogprobs(_Body):
    """A completion choice's log-probabilities: per token its text, log-probability,
    offset in the text and up to k + 1 most likely tokens (the chosen one among them).
    An echoed prompt's first token has null for both."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _TextChoice(_Body):
    index: int
    text: str
    logprobs: TextLogprobs | None
    token_ids: TokenIds = None


class CompletionChoice(_TextChoice):
    finish_reason: FinishReason


class CompletionChunkChoice(_TextChoice):
    finish_reason: FinishReason | None = Field(description="null until the choice ends")


class Completion(_Body):
    """The answer of POST /v1/completions."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Body):
    """One event of a streamed POST /v1/completions (`data: {...}`; the stream ends
    with `data: [DONE]`). With `stream_options.include_usage` the last chunk has no
    choices and carries `usage`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Annotated[Usage | None, _optional("the whole request's usage (last chunk)")] = None


# -- chat completions -------------------------------------------------------------------


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    token_ids: TokenIds = None


class ChatChunkChoice(_Body):
    index: int
    delta: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None = Field(description="null until the choice ends")
    token_ids: TokenIds = None


class ChatCompletion(_Body):
    """The answer of POST /v1/chat/completions."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Body):
    """One event of a streamed POST /v1/chat/completions (`data: {...}`; the stream
    ends with `data: [DONE]`). With `stream_options.include_usage` the last chunk has
    no choices and carries `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Annotated[Usage | None, _optional("the whole request's usage (last chunk)")] = None


# -- models, tokenizer, probes ----------------------------------------------------------


class ModelCard(_Body):
    id: str = Field(description="the served name")
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="where the model was loaded from")
    max_model_len: Annotated[int | None, _optional("the longest prompt plus output")] = None


class ModelList(_Body):
    """The answer of GET /v1/models."""

    object: Literal["list"]
    data: list[ModelCard]


class TokenizeAnswer(_Body):
    """The answer of POST /tokenize."""

    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = Field(description="null unless return_token_strs")


class DetokenizeAnswer(_Body):
    """The answer of POST /detokenize."""

    prompt: str


class ProbeAnswer(_Body):
    """The answer of a probe (/health, /ready), 200 or 503."""

    status: str
    role: Annotated[str | None, _optional("the server's role, once ready")] = None


def probe_answer(status: str, http_status: int = 200, role: str | None = None) -> web.Response:
    """A probe's answer."""
    body = ProbeAnswer(status=status, role=role).model_dump()
    return web.json_response(body, status=http_status)
