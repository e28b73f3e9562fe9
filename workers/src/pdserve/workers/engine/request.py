"""A request inside the engine: its tokens, its progress and its timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.logprobs import TokenLogprob


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended (the OpenAI `finish_reason`, plus `abort`)."""

    STOP = "stop"  # an end-of-sequence token or a stop string/token
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client went away or the request was cancelled


@dataclass(eq=False)
class Request:
    """A request's state. `num_computed_tokens` counts tokens whose K/V are in the
    cache; each step computes some of the rest (a prefill chunk, or the one token
    sampled last, for a decode)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Steps in which prompts that arrived later took prefill tokens before this one's
    # prompt was computed (the scheduler's bound against starvation).
    prefill_overtakes: int = 0
    # P/D hand-off: a prefill worker's request keeps its blocks when it finishes,
    # under a lease (see leases.py), until they are sent.
    hold_blocks: bool = False
    # Choices (n > 1): a choice knows the request it forked from and its index; the
    # request knows its choices once it forked.
    index: int = 0
    parent: Request | None = None
    choices: list[Request] | None = None
    # Log-probabilities of prompt tokens 1.. computed so far (None: not asked for).
    # A recomputed (preempted) prompt skips the positions already here.
    prompt_logprobs: list[TokenLogprob] | None = None
    # The client's name for the request (its X-Request-Id), for logs and for faults
    # injected into one request; never a key.
    label: str | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def forks(self) -> bool:
        """Whether the next token sampled is the first of `n` > 1 choices."""
        return self.params.n > 1 and self.choices is None

    def choice_id(self, index: int) -> str:
        """The engine's id of choice `index` of this request."""
        return f"{self.request_id}#{index}"

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt log-probabilities are still to be computed: then the prompt
        is computed in full, never taken from the prefix cache (a cached position
        computes no logits)."""
        done = self.prompt_logprobs
        return done is not None and len(done) < self.num_prompt_tokens - 1

    @property
    def samples(self) -> bool:
        """Whether computing the prompt's last token also samples (not for
        max_tokens 0: the prompt is all it asks for)."""
        return self.params.max_tokens != 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of `all_token_ids`, without building the whole list (a
        decode step asks for one token of a long sequence)."""
        prompt = self.prompt_token_ids
        split = len(prompt)
        if start >= split:
            return self.output_token_ids[start - split : end - split]
        if end <= split:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - split]

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the last sampled one are still to be computed."""
        return self.num_tokens - self.num_computed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        """True once the request has ended for any reason."""
        return self.status is RequestStatus.FINISHED
