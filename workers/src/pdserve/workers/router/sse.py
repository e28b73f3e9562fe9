"""Watching a worker's SSE stream as the router relays it, byte for byte: when each
token of each choice left, whether the stream ended properly (`[DONE]`), and whether
the worker ended it with an error event.

Only generated tokens count: a completion with `echo` carries the prompt in its
first chunk (with `logprobs`, the prompt's tokens too), and one with `max_tokens: 0`
(scoring the prompt) carries no generated token at all. With `n > 1` each choice is a
stream of its own, interleaved with the others by its index."""

from __future__ import annotations

import json
from typing import Any

import orjson

from pdserve.protocol import codec
from pdserve.protocol.api_errors import error_body
from pdserve.protocol.sse import choice_token_count

DONE = b"data: [DONE]\n\n"
_orjson_loads = orjson.loads


class TokenStream:
    """What a relayed stream carried so far. `echo_tokens`: the prompt's length when the
    request echoes it (its first chunk of each choice carries that many tokens more
    when they are listed); `generates`: False for `max_tokens: 0`."""

    def __init__(self, echo_tokens: int = 0, generates: bool = True) -> None:
        self.echo_tokens = echo_tokens
        self.generates = generates
        self.choices: dict[int, list[float]] = {}  # token times, by choice index
        self.done = False
        self.error: str | None = None
        self._pending = b""

    @property
    def streams(self) -> list[list[float]]:
        """The token times of each choice that carried tokens, by index."""
        if len(self.choices) == 1:  # n = 1
            times = next(iter(self.choices.values()))
            return [times] if times else []
        return [times for _, times in sorted(self.choices.items()) if times]

    @property
    def token_times(self) -> list[float]:
        """Every token's time, of all choices, in order."""
        return sorted(time for times in self.choices.values() for time in times)

    def feed(self, data: bytes, now: float) -> None:
        """Take bytes as they arrived at `now` (events may be split across reads)."""
        events = None
        if not self._pending and data.startswith(b"data: ") and data.endswith(b"\n\n"):
            events = self._whole_events(data)
        if events is None:
            events = self._events(data)
        streams = self.choices
        for event in events:
            if not isinstance(event, dict):
                continue
            if "error" in event:
                self.error = _message(event["error"])
                continue
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                index = choice.get("index", 0)
                if not isinstance(index, int):
                    continue
                times = streams.get(index)
                # A choice's later token, its text alone (no ids, no logprobs), as
                # nearly every event is: one token (see `choice_token_count`), counted
                # here without the calls of the general case.
                if (
                    times is not None
                    and choice.get("text")
                    and choice.get("token_ids") is None
                    and choice.get("logprobs") is None
                ):
                    if self.generates:
                        times.append(now)
                    continue
                self._choice(choice, index, times, now)

    def _whole_events(self, data: bytes) -> list[Any] | None:
        """The events of a read that is whole events, each a `data: ` line and a blank
        line (as a worker writes them, and as they arrive together under load), parsed
        without a Python loop over its lines; None for anything else (`_events` reads
        it line by line, with the same result)."""
        body = data[6:-2]
        done = body.endswith(b"\n\ndata: [DONE]")
        if done:
            body = body[:-14]
        elif body == b"[DONE]":
            self.done = True
            return []
        payloads = body.split(b"\n\ndata: ")
        if body.count(b"\n") != 2 * len(payloads) - 2:
            return None  # other lines: comments, other fields, or an event's data in parts
        try:
            # Each payload parsed alone, as line by line: orjson takes the white space
            # JSON allows around it (what it refuses, `_events` strips or refuses too).
            events = list(map(_orjson_loads, payloads))
        except ValueError:
            return None
        self.done = self.done or done
        return events

    def _events(self, data: bytes) -> list[Any]:
        """The events of `data`, line by line, its unfinished last line kept for the
        next read."""
        pending = self._pending
        *lines, self._pending = (pending + data if pending else data).split(b"\n")
        events = []
        for line in lines:
            # Most lines are an event's `data:` or the blank line ending it (what a
            # line holds around them is white space to strip).
            if not line:
                continue
            if not line.startswith(b"data:"):
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            # Every event is parsed, a token's too: orjson reads one in less than the
            # patterns that once told a plain token event apart cost.
            try:
                events.append(_orjson_loads(payload))
            except ValueError:  # NaN or Infinity (Python's encoder writes them), or no JSON
                try:
                    events.append(codec.loads(payload))
                except ValueError:
                    continue
        return events

    def _choice(
        self, choice: dict[str, Any], index: int, times: list[float] | None, now: float
    ) -> None:
        """The tokens of choice `index` of an event (`times`: its tokens so far, None
        before its first event), left at `now` (none counted when nothing is
        generated)."""
        count = choice_token_count(choice)
        if times is None:
            if self.echo_tokens and _lists_tokens(choice):
                count = max(0, count - self.echo_tokens)  # the first chunk lists the prompt
            times = self.choices[index] = []
        if self.generates:
            if count == 1:
                times.append(now)
            else:
                times.extend([now] * count)


def error_event(message: str, code: str) -> bytes:
    """An SSE event that ends a stream with an error, in OpenAI's error shape, and
    the end of the stream."""
    payload = json.dumps(error_body(message, "server_error", code)).encode()
    return b"data: " + payload + b"\n\n" + DONE


def _lists_tokens(choice: dict[str, Any]) -> bool:
    """Whether a completion choice counts its tokens by its logprobs (which list an
    echoed prompt's tokens too), not by `token_ids` (generated tokens only)."""
    logprobs = choice.get("logprobs")
    if isinstance(choice.get("token_ids"), list) or not isinstance(logprobs, dict):
        return False
    return isinstance(logprobs.get("tokens"), list)


def _message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)
