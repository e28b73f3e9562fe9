"""Tokens to streamed text for one request: incremental detokenization and stop
strings. Text that might be the start of a stop string is held back until it is
known not to be, so a client never sees part of a stop string.

The work per token is bounded by the new text and the stop strings' lengths, never by
the length of the text so far: text is held back only while it could begin a stop
string, so a stop string can never begin in text already sent, and only the held-back
text and the new text need searching. As in vLLM, stop strings count only once
`min_tokens` tokens are out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Detokenizer(Protocol):
    """Turns one request's token ids, one at a time, into text deltas."""

    def add(self, token_id: int) -> str:
        """Feed the next token; return the new complete text (may be empty)."""

    def flush(self) -> str:
        """Release text held back at the end (e.g. an incomplete character)."""


@dataclass
class TextDelta:
    """Text to send now, and whether a stop string ended the request."""

    text: str
    stopped: bool = False


class TextStream:
    """One request's generated text."""

    def __init__(
        self,
        detokenizer: Detokenizer,
        stop: tuple[str, ...],
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._pending = ""  # received, not sent: it might begin a stop string
        self.stopped = False

    def add(self, token_ids: tuple[int, ...]) -> TextDelta:
        """Feed new tokens; return what can be sent now."""
        if self.stopped:
            return TextDelta("", True)
        new = "".join(self._detokenizer.add(token_id) for token_id in token_ids)
        self._num_tokens += len(token_ids)
        if self._num_tokens < self._min_tokens:
            return TextDelta(new)
        return self._release(new, final=False)

    def flush(self) -> str:
        """The rest of the text, once the request has ended."""
        if self.stopped:
            return ""
        return self._release(self._detokenizer.flush(), final=True).text

    def _release(self, new: str, final: bool) -> TextDelta:
        text = self._pending + new
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped = True
            self._pending = ""
            return TextDelta(text[:cut], True)
        keep = 0 if final else self._held_back(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return TextDelta(text[: len(text) - keep])

    def _find_stop(self, text: str) -> int | None:
        """End of the text to keep if a stop string occurs in `text`, else None."""
        found = [(index, stop) for stop in self._stop if (index := text.find(stop)) != -1]
        if not found:
            return None
        index, stop = min(found)
        return index + len(stop) if self._include_stop else index

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held
