"""Workload classes: distributions of prompt and output lengths, in tokens.

A workload is a weighted mix of request classes; each class draws its input and
output lengths uniformly from an inclusive range. The sizes are chosen so that the
project's tiny model on a couple of CPU cores sees both short decodes and prompts
long enough to stall them within a minute of traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthRange:
    """An inclusive range of token counts, sampled uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"bad length range [{self.low}, {self.high}]")

    def sample(self, rng: np.random.Generator) -> int:
        """One length drawn from the range."""
        return int(rng.integers(self.low, self.high, endpoint=True))

    @property
    def mean(self) -> float:
        """The mean of a draw."""
        return (self.low + self.high) / 2


@dataclass(frozen=True)
class RequestClass:
    """A kind of request: how long its prompt is and how many tokens it asks for."""

    name: str
    input: LengthRange
    output: LengthRange


@dataclass(frozen=True)
class Workload:
    """A weighted mix of request classes."""

    name: str
    mix: tuple[tuple[RequestClass, float], ...]

    def sample(
        self, rng: np.random.Generator, max_input: int | None, max_output: int | None
    ) -> tuple[str, int, int]:
        """Draw (class name, input tokens, output tokens), clipped to the limits."""
        weights = np.array([weight for _, weight in self.mix], dtype=float)
        index = int(rng.choice(len(self.mix), p=weights / weights.sum()))
        request_class = self.mix[index][0]
        input_tokens = clip_length(request_class.input.sample(rng), max_input)
        output_tokens = clip_length(request_class.output.sample(rng), max_output)
        return request_class.name, input_tokens, output_tokens

    def mean_tokens(self) -> float:
        """The mean prompt plus output tokens of a request drawn from the mix (no
        limits): the work of the workload's average request."""
        weighted = sum(
            weight * (request_class.input.mean + request_class.output.mean)
            for request_class, weight in self.mix
        )
        return weighted / sum(weight for _, weight in self.mix)


def clip_length(tokens: int, limit: int | None) -> int:
    """`tokens` capped at `limit` (when given) and never below one."""
    if limit is not None:
        tokens = min(tokens, limit)
    return max(1, tokens)


CHAT = RequestClass("chat", input=LengthRange(64, 256), output=LengthRange(32, 128))
RAG = RequestClass("rag", input=LengthRange(1024, 3072), output=LengthRange(16, 64))
LONG = RequestClass("long", input=LengthRange(1024, 3072), output=LengthRange(256, 1024))

WORKLOADS: dict[str, Workload] = {
    "chat": Workload("chat", ((CHAT, 1.0),)),
    "rag": Workload("rag", ((RAG, 1.0),)),
    "long": Workload("long", ((LONG, 1.0),)),
    # Mostly interactive traffic with a share of long prompts: the case where a
    # prefill run in one piece shows up as stutter in everyone else's stream.
    "mixed": Workload("mixed", ((CHAT, 0.85), (RAG, 0.15))),
}


def workload_named(name: str, long_share: float | None = None) -> Workload:
    """The workload `name`; for `mixed`, `long_share` replaces the share of long
    (rag) prompts."""
    workload = WORKLOADS[name]
    if long_share is None or name != "mixed":
        return workload
    return Workload("mixed", ((CHAT, 1.0 - long_share), (RAG, long_share)))
