"""What a worker accepts: size limits on a request's parts, and admission control
(a bounded queue, answered 429 with Retry-After when full). The limits are flags of
both `pdserve worker` and `pdserve router`, declared here once; the router applies
the same checks before it forwards a request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.base.options import option, parse_bytes, positive_int
from pdserve.protocol.api_errors import APIError
from pdserve.protocol.sampling import SamplingParams

LIMITS = "limits (past them a request gets a 4xx or 5xx with the reason)"


@dataclass(frozen=True)
class RequestLimits:
    """Limits on one request and its parts (flags of the worker and the router)."""

    max_body_size: int = option(
        8 * 1024 * 1024, parse=parse_bytes, metavar="BYTES", group=LIMITS,
        help="largest request body, e.g. 8MiB (larger: 413)",
    )  # fmt: skip
    max_stop_strings: int = option(
        16, parse=positive_int, group=LIMITS, help="most stop strings per request (400)"
    )
    max_stop_length: int = option(
        256, parse=positive_int, group=LIMITS, help="longest stop string, in characters (400)"
    )
    max_stop_token_ids: int = option(
        256, parse=positive_int, group=LIMITS, help="most stop_token_ids per request (400)"
    )
    max_logprobs: int = option(
        20, parse=positive_int, group=LIMITS,
        help="most alternatives per token in logprobs, top_logprobs and an echoed "
        "prompt's logprobs (400)",
    )  # fmt: skip
    max_n: int = option(
        16, parse=positive_int, group=LIMITS,
        help="most choices per request, n (400; a worker also caps it at --max-num-seqs)",
    )  # fmt: skip

    def check(self, params: SamplingParams) -> None:
        """A 400 naming the first limit `params` exceeds."""
        self._check_choices(params)
        if len(params.stop) > self.max_stop_strings:
            raise APIError(
                400, f"stop: at most {self.max_stop_strings} stop strings, got {len(params.stop)}"
            )
        longest = max(map(len, params.stop)) if params.stop else 0
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
