"""The OpenAI-shaped answers of a worker: completion bodies, streamed chunks (each
built through its model in `response_models`), and the per-request record of tokens
and their times that fills `usage` and metrics."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from pdserve.protocol.api_errors import REQUEST_FAILED, APIError
from pdserve.protocol.response_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
)
from pdserve.protocol.sampling import InvalidRequestError, SamplingParams
from pdserve.workers.engine.async_engine import EngineDeadError, QueueTimeoutError
from pdserve.workers.engine.isolation import RequestFailedError
from pdserve.workers.engine.output_buffer import StreamOverflowError
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.handoff.errors import HandoffError

# The model of an answer, by (chat, whole): what each endpoint sends, whole or streamed.
_BODIES: dict[tuple[bool, bool], type[BaseModel]] = {
    (False, True): Completion,
    (False, False): CompletionChunk,
    (True, True): ChatCompletion,
    (True, False): ChatCompletionChunk,
}


@dataclass
class PreparedRequest:
    """A validated request, ready for the engine."""

    request_id: str
    model: str  # as the client named it (the served name when it named none)
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    return_token_ids: bool
    logprobs: bool = False  # whether choices carry log-probabilities
    echo_text: str | None = None  # completions with echo: the prompt, sent first
    label: str | None = None  # the client's X-Request-Id (logs; faults aimed at it)


@dataclass
class ChoiceDelta:
    """What there is to send of one choice: new text, the new tokens and their
    log-probabilities (None: not asked for), and the reason once it ended."""

    index: int
    text: str = ""
    reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None

    def extend(self, delta: ChoiceDelta) -> None:
        """Append a later delta of the same choice."""
        self.text += delta.text
        self.reason = delta.reason or self.reason
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = {key: [] for key in delta.logprobs}
            for key, values in delta.logprobs.items():
                self.logprobs[key] += values


class RequestTracker:
    """Token times and counts of one request as the server saw them."""

    def __init__(self, prepared: PreparedRequest, arrival: float) -> None:
        self.prepared = prepared
        self.arrival = arrival
        # When the steps that gave the request tokens ended: one time per step, however
        # many of its choices got a token in it.
        self.token_times: list[float] = []
        self.num_output_tokens: dict[int, int] = {}  # by choice
        self.num_cached_tokens = 0
        self.reason = "abort"
        self.mode = "colocated"
        # Why a request that named a prefill worker was prefilled here (`cached`,
        # `failed`; None: it was not).
        self.handoff: str | None = None

    def record(self, output: RequestOutput, reason: str | None) -> None:
        """Account for an output; `reason`: its choice's, if it ended."""
        if output.new_token_ids and (not self.token_times or self.token_times[-1] != output.time):
            self.token_times.append(output.time)
        self.num_output_tokens[output.index] = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if reason is not None:
            self.reason = reason

    def usage(self) -> dict[str, Any]:
        prompt = len(self.prepared.prompt_token_ids)
        completion = sum(self.num_output_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


def completion_body(
    prepared: PreparedRequest,
    choices: Sequence[ChoiceDelta],
    final: bool,
    usage: dict[str, Any] | None = None,
) -> BaseModel:
    """A completion (final=True, with its `usage`) or a streamed chunk (`usage` on the
    last one, when asked for), for either endpoint."""
    kind = "chat.completion" if prepared.chat else "text_completion"
    if prepared.chat and not final:
        kind = "chat.completion.chunk"
    body: dict[str, Any] = {
        "id": prepared.request_id,
        "object": kind,
        "created": int(time.time()),
        "model": prepared.model,
        "choices": [_choice(prepared, choice, final) for choice in choices],
    }
    if usage is not None:
        body["usage"] = usage
    return _BODIES[prepared.chat, final].model_validate(body)


def _choice(prepared: PreparedRequest, choice: ChoiceDelta, final: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"index": choice.index}
    if prepared.chat:
        body["message" if final else "delta"] = {"role": "assistant", "content": choice.text}
    else:
        body["text"] = choice.text
    body["logprobs"] = choice.logprobs
    body["finish_reason"] = choice.reason
    if prepared.return_token_ids:
        body["token_ids"] = choice.token_ids
    return body


# What the engine or a hand-off raises for one request; `api_error` says how each is
# answered.
REQUEST_ERRORS = (
    HandoffError,
    EngineDeadError,
    QueueTimeoutError,
    InvalidRequestError,
    RequestFailedError,
    StreamOverflowError,
)


def api_error(error: Exception) -> APIError:
    """The HTTP error that stands for an engine's or a hand-off's failure of a request
    (one of REQUEST_ERRORS)."""
    if isinstance(error, HandoffError):
        return APIError(502, f"prefill hand-off failed: {error}", "server_error", error.code)
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), "server_error", "engine_stopped")
    if isinstance(error, QueueTimeoutError):
        return APIError(503, str(error), "server_error", "queue_timeout")
    if isinstance(error, StreamOverflowError):
        return APIError(503, str(error), "server_error", "stream_buffer_full")
    if isinstance(error, RequestFailedError) and not error.invalid:
        # The request's failure alone, not the worker's: the router does not retry it.
        return APIError(500, str(error), "server_error", REQUEST_FAILED)
    return APIError(400, str(error))


async def first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output, or the HTTP error that stands for why there is none."""
    try:
        return await anext(outputs)
    except REQUEST_ERRORS as error:
        raise api_error(error) from error


async def chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncGenerator[RequestOutput, None]:
    yield first
    async for output in rest:
        yield output


async def send_event(response: web.StreamResponse, payload: BaseModel | dict[str, Any]) -> None:
    """Write one SSE event."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json().encode()
    else:
        data = json.dumps(payload).encode()
    await response.write(b"data: " + data + b"\n\n")
