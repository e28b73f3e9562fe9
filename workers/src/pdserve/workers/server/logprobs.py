"""Log-probabilities in OpenAI's shapes.

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, where each
`top_logprobs` entry maps token text to log-probability for the chosen token and the
k most likely ones (so up to k + 1 entries, as OpenAI documents), and an echoed
prompt's first token has null for both. Chat: `{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}` with exactly the k most likely as
alternatives. A token's text is its own bytes, decoded with replacement, so a token
that splits a character shows U+FFFD while `bytes` holds the real bytes.
Log-probabilities of -inf (tokens the processed distribution cuts off) are sent as
-9999.0, as OpenAI and vLLM do: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.workers.engine.logprobs import TokenLogprob
from pdserve.workers.model.tokenizer import Tokenizer

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class CompletionLogprobs:
    """One choice's completion log-probabilities, chunk by chunk: text offsets run
    on across chunks (from the echoed prompt's start when there is one)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._offset = 0

    def shape(
        self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int]
    ) -> dict[str, Any]:
        """The `logprobs` object for these tokens (`entries[i]` None: no
        log-probability, the prompt's first token)."""
        shaped: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry, token_id in zip(entries, token_ids, strict=True):
            text = self._text(token_id)
            shaped["tokens"].append(text)
            shaped["text_offset"].append(self._offset)
            self._offset += len(text)
            if entry is None:
                shaped["token_logprobs"].append(None)
                shaped["top_logprobs"].append(None)
                continue
            shaped["token_logprobs"].append(_value(entry.logprob))
            top = {text: _value(entry.logprob)}
            for alternative, logprob in entry.top:
                top.setdefault(self._text(alternative), _value(logprob))
            shaped["top_logprobs"].append(top)
        return shaped

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object for these sampled tokens."""
    return {
        "content": [
            {
                **_chat_token(tokenizer, entry.token_id, entry.logprob),
                "top_logprobs": [
                    _chat_token(tokenizer, token_id, logprob) for token_id, logprob in entry.top
                ],
            }
            for entry in entries
        ]
    }


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": _value(logprob),
        "bytes": list(raw),
    }
