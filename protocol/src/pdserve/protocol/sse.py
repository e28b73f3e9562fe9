"""Counting the tokens of an OpenAI server-sent event stream, the same way wherever it is
read: the router relaying a worker's stream and the load generator measuring one."""

from __future__ import annotations

from typing import Any


def chunk_token_count(event: dict[str, Any]) -> int:
    """How many tokens one streamed chunk carries (of its first choice; see
    `choice_token_count`)."""
    choices = event.get("choices") or []
    return choice_token_count(choices[0]) if choices else 0


def choice_token_count(choice: dict[str, Any]) -> int:
    """How many tokens one choice of a streamed chunk carries.

    An explicit count wins (`token_ids`, `logprobs.tokens`, or chat's
    `logprobs.content`). Otherwise a chunk is one token, even with empty text: servers
    send a chunk per generated token and hold back text that ends inside a multi-byte
    character, and ITL is about when tokens come, not when they become printable. The
    exception is an empty chunk that only closes the stream (it has a finish reason).
    Chunks that silently carry several tokens are reconciled with the final usage
    afterwards (see metrics).
    """
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids)
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for key in ("tokens", "content"):
            if isinstance(logprobs.get(key), list):
                return len(logprobs[key])
    delta = choice.get("delta")
    text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
    if not text and choice.get("finish_reason") is not None:
        return 0
    return 1
