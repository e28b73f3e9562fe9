"""The OpenAI-shaped answers of a worker: completion bodies, streamed chunks, and
the per-request record of tokens and their times that fills `usage` and metrics."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.workers.api_errors import APIError
from pdserve.workers.engine.async_engine import EngineDeadError, QueueTimeoutError
from pdserve.workers.engine.sampling import InvalidRequestError, SamplingParams
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.handoff.errors import HandoffError


@dataclass
class PreparedRequest:
    """A validated request, ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    return_token_ids: bool


class RequestTracker:
    """Token times and counts of one request as the server saw them."""

    def __init__(self, prepared: PreparedRequest, arrival: float) -> None:
        self.prepared = prepared
        self.arrival = arrival
        self.token_times: list[float] = []
        self.token_ids: list[int] = []
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.reason = "abort"
        self.mode = "colocated"

    def record(self, output: RequestOutput) -> None:
        self.token_times.extend(output.time for _ in output.new_token_ids)
        self.token_ids.extend(output.new_token_ids)
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finish_reason is not None:
            self.reason = output.finish_reason.value

    def usage(self) -> dict[str, Any]:
        prompt = len(self.prepared.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": prompt + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


def completion_body(
    prepared: PreparedRequest, text: str, reason: str | None, final: bool
) -> dict[str, Any]:
    """A completion (final=True) or a streamed chunk, for either endpoint."""
    created = int(time.time())
    if prepared.chat:
        content_key = "message" if final else "delta"
        choice = {
            "index": 0,
            content_key: {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": None,
        }
        kind = "chat.completion" if final else "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        kind = "text_completion"
    return {"id": prepared.request_id, "object": kind, "created": created, "choices": [choice]}


async def first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output, or the HTTP error that stands for why there is none."""
    try:
        return await anext(outputs)
    except HandoffError as error:
        raise APIError(
            502, f"prefill hand-off failed: {error}", "server_error", error.code
        ) from error
    except EngineDeadError as error:
        raise APIError(503, str(error), "server_error", "engine_stopped") from error
    except QueueTimeoutError as error:
        raise APIError(503, str(error), "server_error", "queue_timeout") from error
    except InvalidRequestError as error:
        raise APIError(400, str(error)) from error


async def chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncGenerator[RequestOutput, None]:
    yield first
    async for output in rest:
        yield output


async def send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
