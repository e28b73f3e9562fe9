"""What one request did, as the client saw it: the raw material of every metric."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Times (`time.perf_counter` seconds) and outcome of one request.

    The client fills it in as the response streams; metrics are derived from it
    afterwards, so the hot path does no arithmetic beyond taking timestamps.
    """

    index: int
    kind: str
    input_tokens: int
    requested_output_tokens: int
    scheduled_at: float
    sent_at: float | None = None
    # One entry per streamed chunk that carried tokens: arrival time and token count.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None  # prompt tokens the server found cached
    status: int | None = None
    mode: str | None = None  # how the server says it served it (a router's X-Pdserve-Mode)
    error: str | None = None
    finished: bool = False
    ended_at: float | None = None
    finish_reason: str | None = None  # of the first choice, once a chunk gave one

    @property
    def ok(self) -> bool:
        """The request streamed to its end with at least one token and no error."""
        return self.finished and self.error is None and bool(self.chunk_times)

    def fail(self, message: str, now: float) -> None:
        """Mark the request failed (the first reason given is kept)."""
        if self.error is None:
            self.error = message
        if self.ended_at is None:
            self.ended_at = now
