"""Sampling parameters of one request, validated when the request arrives."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace

# Temperatures below this sample greedily, as in vLLM: dividing logits by a smaller one
# overflows the sampler's float32 (1e-300 is 0 there), and the distribution is then
# one token anyway.
GREEDY_TEMPERATURE = 1e-5


# Sets an attribute past a frozen class's own __setattr__ (as a frozen dataclass's
# __init__ does).
_set_dict = object.__setattr__


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says why (an HTTP 400 to the client)."""


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 (or below GREEDY_TEMPERATURE) is greedy. A seed makes a sampled
    request reproducible, whatever else shares its batch. With `n` > 1 the prompt is
    computed once and `n` choices are drawn from it; choice i behaves as a request of
    its own with seed `seed + i`.
    max_tokens 0 computes the prompt (for its log-probabilities) and samples nothing.

    Immutable, as a frozen dataclass is (assigning a field raises
    FrozenInstanceError); made by its own `__init__`, which sets every field in one
    write of the instance's dict where a frozen dataclass's makes a call per field
    (one is made for every request, in the router and the worker alike).
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
    n: int = 1
    logprobs: int | None = None  # per sampled token: its logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token

    def __init__(
        self,
        max_tokens: int | None = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
        n: int = 1,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        # The fields' names, order and defaults are those declared above (a test
        # holds them equal).
        _set_dict(self, "__dict__", {
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "seed": seed, "stop": stop, "stop_token_ids": stop_token_ids,
            "ignore_eos": ignore_eos, "min_tokens": min_tokens,
            "include_stop_str_in_output": include_stop_str_in_output, "n": n,
            "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
        })  # fmt: skip

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken (no randomness)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first parameter out of range."""
        for failed in self._failures():
            raise InvalidRequestError(failed)

    def _failures(self) -> Iterator[str]:
        """What is out of range, in order (each message made only when it is, as every
        request is validated)."""
        if not (self.max_tokens is None or self.max_tokens >= 0):
            yield "max_tokens must not be negative"
        if not 0.0 <= self.temperature <= 100.0:
            yield "temperature must be between 0 and 100"
        if not 0.0 < self.top_p <= 1.0:
            yield "top_p must be in (0, 1]"
        # From 1e-44 up, a value is a float32 above 0: converted only below that.
        if not (self.top_p >= 1e-44 or as_float32(self.top_p) > 0.0):
            yield (
                f"top_p {self.top_p!r} rounds to 0 in the sampler's float32: it must be "
                "at least 1e-45"
            )
        if not self.top_k >= 0:
            yield "top_k must be 0 (disabled) or positive"
        if not self.min_tokens >= 0:
            yield "min_tokens must not be negative"
        if not (self.max_tokens is None or self.min_tokens <= self.max_tokens):
            yield "min_tokens must not exceed max_tokens"
        if not all(self.stop):
            yield "stop strings must not be empty"
        if not (self.seed is None or 0 <= self.seed <= 2**63 - self.n):
            yield "seed must be in [0, 2**63 - n]"
        if not self.n >= 1:
            yield "n must be at least 1"
        if not (self.logprobs is None or self.logprobs >= 0):
            yield "logprobs must not be negative"
        if not (self.prompt_logprobs is None or self.prompt_logprobs >= 0):
            yield "prompt_logprobs must not be negative"

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of a request with n > 1: a request of its
        own, seeded `seed + index`, whose prompt is already computed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, prompt_logprobs=None)


def as_float32(value: float) -> float:
    """`value` as the sampler computes with it (float32, rounded to nearest)."""
    return array("f", [value])[0]
