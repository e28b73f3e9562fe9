"""What a worker accepts: size limits on a request's parts, and admission control
(a bounded queue, answered 429 with Retry-After when full). The limits are the
worker's flags; the router applies the same checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.workers.api_errors import APIError
from pdserve.workers.engine.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """Limits on one request's parts (each a `pdserve worker` flag)."""

    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_stop_token_ids: int = 256
    max_logprobs: int = 20
    max_n: int = 16

    def check(self, params: SamplingParams) -> None:
        """A 400 naming the first limit `params` exceeds."""
        self._check_choices(params)
        if len(params.stop) > self.max_stop_strings:
            raise APIError(
                400, f"stop: at most {self.max_stop_strings} stop strings, got {len(params.stop)}"
            )
        longest = max((len(stop) for stop in params.stop), default=0)
        if longest > self.max_stop_length:
            raise APIError(
                400, f"stop: stop strings may have at most {self.max_stop_length} characters, "
                f"got one of {longest}",
            )  # fmt: skip
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise APIError(
                400, f"stop_token_ids: at most {self.max_stop_token_ids} ids, "
                f"got {len(params.stop_token_ids)}",
            )  # fmt: skip

    def _check_choices(self, params: SamplingParams) -> None:
        if params.n > self.max_n:
            raise APIError(400, f"n: at most {self.max_n} choices per request, got {params.n}")
        widest = max(params.logprobs or 0, params.prompt_logprobs or 0)
        if widest > self.max_logprobs:
            raise APIError(
                400, f"logprobs/top_logprobs: at most {self.max_logprobs} alternatives per token "
                f"(--max-logprobs), got {widest}",
            )  # fmt: skip


class Admission:
    """A bounded queue: a request is admitted while fewer than `max_queued` wait for
    their first engine step, else refused with 429 and a hint when to retry."""

    RETRY_AFTER_S = 1

    def __init__(self, max_queued: int, queued: Callable[[], int]) -> None:
        self.max_queued = max_queued
        self._queued = queued

    def admit(self) -> None:
        """Raise the 429 when the queue is full."""
        queued = self._queued()
        if queued >= self.max_queued:
            raise APIError(
                429, f"the server is busy: {queued} requests are queued (the most is "
                f"{self.max_queued}); retry later", "rate_limit_exceeded", "queue_full",
                headers={"Retry-After": str(self.RETRY_AFTER_S)},
            )  # fmt: skip
