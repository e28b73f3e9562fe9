"""The choices of one answer as they build up, output by output: text (a stop string's
start held back), token ids, log-probabilities in the endpoint's shape, the echoed
prompt, and why each choice ended. A choice ends when the engine ends it or when its
text reaches a stop string."""

from __future__ import annotations

from typing import Any

from pdserve.workers import faults
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.workers.server.logprobs import CompletionLogprobs, chat_logprobs
from pdserve.workers.server.responses import ChoiceDelta, PreparedRequest
from pdserve.workers.server.text_stream import TextStream


class Choice:
    """One choice of an answer."""

    def __init__(self, index: int, prepared: PreparedRequest, tokenizer: Tokenizer) -> None:
        params = prepared.params
        self.index = index
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.text = TextStream(
            IncrementalDetokenizer(tokenizer, prepared.prompt_token_ids),
            params.stop,
            params.include_stop_str_in_output,
            params.min_tokens,
        )
        self.completion_logprobs = CompletionLogprobs(tokenizer)
        self.reason: str | None = None  # set once the choice ended
        self.stopped_by_text = False
        self.num_output_tokens = 0
        # Everything so far, for an answer sent whole; a stream keeps nothing of what
        # it sent (with n and logprobs, that would be megabytes a request).
        self.whole = ChoiceDelta(index)
        self._started = False

    @property
    def ended(self) -> bool:
        """Whether the choice has ended (nothing more is sent of it)."""
        return self.reason is not None

    def add(self, output: RequestOutput) -> ChoiceDelta:
        """Take the engine's output for this choice; what to send of it now."""
        faults.blocking_point("server.detokenize", labels=(self.prepared.label,))
        first, self._started = not self._started, True
        tokens = output.new_token_ids
        delta = self.text.add(tokens)
        self.stopped_by_text = self.text.stopped
        if self.stopped_by_text:
            self.reason = "stop"
        elif output.finish_reason is not None:
            self.reason = output.finish_reason.value
        text = delta.text + (self.text.flush() if self.ended else "")
        self.num_output_tokens = output.num_output_tokens
        echo = self.prepared.echo_text if first else None
        piece = ChoiceDelta(
            index=self.index,
            text=(echo or "") + text,
            reason=self.reason,
            token_ids=list(tokens),
            logprobs=self._logprobs(output, first),
        )
        if not self.prepared.stream:
            self.whole.extend(piece)
        return piece

    def _logprobs(self, output: RequestOutput, first: bool) -> dict[str, Any] | None:
        if not self.prepared.logprobs:
            return None
        entries = list(output.logprobs or ())
        if self.prepared.chat:
            return chat_logprobs(self.tokenizer, entries)
        token_ids = list(output.new_token_ids)
        if first and self.prepared.echo_text is not None and output.prompt_logprobs is not None:
            token_ids = self.prepared.prompt_token_ids + token_ids
            return self.completion_logprobs.shape([*output.prompt_logprobs, *entries], token_ids)
        return self.completion_logprobs.shape(entries, token_ids)
