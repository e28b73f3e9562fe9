"""Tokens to streamed text for one request: incremental detokenization and stop
strings. Text that might be the start of a stop string is held back until it is
known not to be, so a client never sees part of a stop string."""

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
        self, detokenizer: Detokenizer, stop: tuple[str, ...], include_stop: bool = False
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._include_stop = include_stop
        self._text = ""
        self._sent = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text sent so far."""
        return self._text[: self._sent]

    def add(self, token_ids: tuple[int, ...]) -> TextDelta:
        """Feed new tokens; return what can be sent now."""
        if self.stopped:
            return TextDelta("", True)
        searched_from = len(self._text)
        for token_id in token_ids:
            self._text += self._detokenizer.add(token_id)
        if self._stop:
            cut = self._find_stop(searched_from)
            if cut is not None:
                self._text = self._text[:cut]
                self.stopped = True
                return TextDelta(self._send(len(self._text)), True)
        return TextDelta(self._send(len(self._text) - self._held_back()))

    def flush(self) -> str:
        """The rest of the text, once the request has ended."""
        if not self.stopped:
            searched_from = len(self._text)
            self._text += self._detokenizer.flush()
            cut = self._find_stop(searched_from) if self._stop else None
            if cut is not None:
                self._text = self._text[:cut]
                self.stopped = True
        return self._send(len(self._text))

    def _send(self, upto: int) -> str:
        delta = self._text[self._sent : upto]
        self._sent = max(self._sent, upto)
        return delta

    def _find_stop(self, searched_from: int) -> int | None:
        """End of the kept text if a stop string appeared (starting at or after the
        earliest place a new match can start); None otherwise."""
        longest = max(len(stop) for stop in self._stop)
        start = max(0, searched_from - longest + 1)
        found = [
            (index, stop) for stop in self._stop if (index := self._text.find(stop, start)) != -1
        ]
        if not found:
            return None
        index, stop = min(found)
        return index + len(stop) if self._include_stop else index

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:size]):
                    held = size
                    break
        return held
