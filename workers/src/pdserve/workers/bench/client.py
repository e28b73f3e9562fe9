"""A streaming client for OpenAI-compatible completions that records timings.

The hot path (one call per network read) takes a timestamp, parses the events and
appends to the record; everything else is computed after the run.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from pdserve.protocol.headers import MODE_HEADER
from pdserve.protocol.sse import chunk_token_count
from pdserve.workers.bench.records import RequestRecord


class ServerError(RuntimeError):
    """The server could not be used at all (unreachable, or no model to name)."""


class CompletionsClient:
    """Sends prompts (token ids, or text) to `{base_url}/v1/completions` and streams
    the answers."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, model: str, ignore_eos: bool = True
    ) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._model = model
        self._ignore_eos = ignore_eos

    async def send(self, record: RequestRecord, prompt: list[int] | str) -> None:
        """Send one request and fill `record` as the response streams in."""
        payload: dict[str, Any] = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": record.requested_output_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._ignore_eos:
            payload["ignore_eos"] = True
        record.sent_at = time.perf_counter()
        try:
            async with self._session.post(self._url, json=payload) as response:
                record.status = response.status
                record.mode = response.headers.get(MODE_HEADER)
                if response.status >= 400:
                    message = await _error_message(response)
                    record.fail(f"HTTP {response.status}: {message}", time.perf_counter())
                    return
                await _read_stream(response, record)
        except (TimeoutError, aiohttp.ClientError) as error:
            record.fail(f"{type(error).__name__}: {error}", time.perf_counter())
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            # Whatever the server sent could not be read as a completions stream.
            record.fail(f"bad response: {type(error).__name__}: {error}", time.perf_counter())


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    # Whole network reads, split here: one timestamp per read (events that came in the
    # same read did arrive together), and far fewer calls than reading line by line.
    pending = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if _take_line(record, line, now):
                return
    if pending.strip() and _take_line(record, pending, time.perf_counter()):
        return
    if record.finish_reason is not None:
        # Ended without [DONE] after the choice finished: some servers (transformers
        # serve) close the stream there, and the answer is whole.
        _finish(record, time.perf_counter())
    else:
        record.fail("stream ended before [DONE]", time.perf_counter())


def _take_line(record: RequestRecord, raw: bytes, now: float) -> bool:
    """Record one SSE line; True when the stream is over (done or failed)."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return False  # blank separators, comments and keep-alives
    data = line[5:].strip()
    if data == b"[DONE]":
        _finish(record, now)
        return True
    event = json.loads(data)
    if not isinstance(event, dict):
        record.fail(f"unexpected event {data[:100]!r}", now)
        return True
    if "error" in event:
        record.fail(f"stream error: {_message_of(event)}", now)
        return True
    _take_event(record, event, now)
    return False


def _take_event(record: RequestRecord, event: dict[str, Any], now: float) -> None:
    usage = event.get("usage")
    if usage:
        record.usage_prompt_tokens = usage.get("prompt_tokens")
        record.usage_completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.usage_cached_tokens = details["cached_tokens"]
    choices = event.get("choices") or []
    if choices and choices[0].get("finish_reason") is not None:
        record.finish_reason = str(choices[0]["finish_reason"])
    tokens = chunk_token_count(event)
    if tokens:
        record.chunk_times.append(now)
        record.chunk_tokens.append(tokens)


def _finish(record: RequestRecord, now: float) -> None:
    if not record.chunk_times:
        record.fail("the stream carried no tokens", now)
        return
    record.finished = True
    record.ended_at = now


async def _error_message(response: aiohttp.ClientResponse) -> str:
    body = await response.text()
    try:
        return _message_of(json.loads(body))
    except ValueError:
        return body.strip()[:200] or response.reason or "no message"


def _message_of(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if error is not None:
            return str(error)
    return str(body)[:200]


async def fetch_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists at `/v1/models`."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url) as response:
            if response.status >= 400:
                raise ServerError(
                    f"GET {url}: HTTP {response.status}: {await _error_message(response)}"
                )
            body = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError) as error:
        raise ServerError(f"cannot reach {url}: {error}") from error
    models = body.get("data") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ServerError(f"GET {url}: no model listed; pass --model")
    return str(models[0]["id"])
