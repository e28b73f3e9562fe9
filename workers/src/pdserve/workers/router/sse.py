"""Watching a worker's SSE stream as the router relays it, byte for byte: when each
token left, whether the stream ended properly (`[DONE]`), and whether the worker
ended it with an error event."""

from __future__ import annotations

import json
from typing import Any

from pdserve.workers.api_errors import error_body
from pdserve.workers.bench.client import chunk_token_count

DONE = b"data: [DONE]\n\n"


class TokenStream:
    """What a relayed stream carried so far."""

    def __init__(self) -> None:
        self.token_times: list[float] = []
        self.done = False
        self.error: str | None = None
        self._pending = b""

    def feed(self, data: bytes, now: float) -> None:
        """Take bytes as they arrived at `now` (events may be split across reads)."""
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            self._line(line.strip(), now)

    def _line(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            self.error = _message(event["error"])
            return
        self.token_times.extend([now] * chunk_token_count(event))


def error_event(message: str, code: str) -> bytes:
    """An SSE event that ends a stream with an error, in OpenAI's error shape, and
    the end of the stream."""
    payload = json.dumps(error_body(message, "server_error", code)).encode()
    return b"data: " + payload + b"\n\n" + DONE


def _message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)
