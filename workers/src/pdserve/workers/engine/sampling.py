"""Sampling parameters of one request, validated when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says why (an HTTP 400 to the client)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy. A seed makes a sampled request reproducible, whatever
    else shares its batch.
    """

    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken (no randomness)."""
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first parameter out of range."""
        checks: list[tuple[bool, str]] = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be between 0 and 100"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be 0 (disabled) or positive"),
            (self.min_tokens >= 0, "min_tokens must not be negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
            ),
            (all(self.stop), "stop strings must not be empty"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
