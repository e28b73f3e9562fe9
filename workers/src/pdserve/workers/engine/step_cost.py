"""The step-cost model: how long an engine step takes, learned online from the
engine's own steps.

A step's time is modelled as linear in what its batch makes the model do:

    seconds = base + per decode token * decode tokens + per prefill token * prefill tokens
              + per decode key * decode keys + per prefill key * prefill keys

Tokens pay for the projections and the MLP; *keys* are the cached tokens attention
reads, counted as the runner computes them (see `attention.py`): decodes are attended
in groups of similar context length (`decode_groups`), each reading as many keys as the
longest of its group, and a prefill chunk of n tokens ending at position e runs n
queries over e keys.

The coefficients are fit by least squares over all steps so far, each weighted down by
a forgetting factor per step since, so the model follows a device whose speed drifts
(clocks, other processes). The fit is kept as its normal equations, updated in O(1)
per step and re-solved with every cost held non-negative. Residuals are Huber-weighted,
so a step slowed by something outside its batch (a page fault, a preempted thread)
pulls the fit by a bounded amount. The safety margin is a high quantile of the errors
the current fit makes on the recent steps that mixed decodes and prefill (the steps
whose size the budget policy decides): errors measured against the fit as it is now,
not as it was when each step ran, so the large errors of a model still learning (a
term the first steps did not exercise, such as the keys of the first long prompts)
leave the margin as soon as the fit has learned from them, rather than holding it
high, and the budget small, for a whole window of steps.
"""

from __future__ import annotations

import heapq
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.workers.engine.decode_groups import attended_keys


class Span(Protocol):
    """What the features read of a scheduled chunk (the scheduler's chunks are spans;
    this module is below the scheduler, whose budget policy asks it for costs)."""

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


# Units of the terms inside the fit (tens of decodes, thousands of prefill tokens,
# ...), so that typical steps give every term a similar size.
_SCALES = (1.0, 10.0, 1e3, 1e5, 1e7)
_TERMS = range(len(_SCALES))
Vector = tuple[float, ...]


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes, in the terms of the cost model."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    decode_keys: int = 0
    prefill_keys: int = 0

    @classmethod
    def of(cls, chunks: Iterable[Span]) -> StepFeatures:
        """The features of a scheduled step."""
        return cls.of_spans((chunk.start, chunk.num_tokens) for chunk in chunks)

    @classmethod
    def of_spans(cls, spans: Iterable[tuple[int, int]]) -> StepFeatures:
        """The features of a step whose chunks are (start, tokens) spans (as a step log
        tells them). A one-token chunk takes the runner's batched decode path, whatever
        it computes."""
        decodes: list[int] = []  # each decode's context, its new token included
        prefill_tokens, prefill_keys = 0, 0
        for start, tokens in spans:
            end = start + tokens
            if tokens == 1:
                decodes.append(end)
            else:
                prefill_tokens += tokens
                prefill_keys += tokens * end
        return cls(len(decodes), prefill_tokens, attended_keys(decodes), prefill_keys)

    def vector(self) -> Vector:
        """The regression's input: a constant, then the four counts (scaled)."""
        raw = (1, self.decode_tokens, self.prefill_tokens, self.decode_keys, self.prefill_keys)
        return tuple(count / scale for count, scale in zip(raw, _SCALES, strict=True))


@dataclass(frozen=True)
class StepCostEstimate:
    """What the model believes, in seconds: the cost of each term and the margin."""

    base_s: float
    per_decode_token_s: float
    per_prefill_token_s: float
    per_decode_key_s: float
    per_prefill_key_s: float
    margin_s: float
    num_steps: int  # steps the model has learned from
    # Prompt tokens it learned the prefill terms from, each step's counting less by
    # the fit's forgetting since: how far its prefill costs are its own evidence.
    prefill_tokens: float = 0.0


class StepCostModel:
    """Predicts step durations from `StepFeatures`; `update` teaches it one step."""

    def __init__(
        self,
        forgetting: float = 0.995,
        huber_k: float = 3.0,
        margin_quantile: float = 0.99,
        margin_window: int = 256,
        warmup_steps: int = 16,
        sweeps: int = 3,
    ) -> None:
        self.forgetting = forgetting
        self.huber_k = huber_k
        self.margin_quantile = margin_quantile
        self.warmup_steps = warmup_steps
        self.sweeps = sweeps
        self.num_steps = 0
        self.prefill_steps = 0  # of them, the steps that computed prefill
        self.prefill_tokens = 0.0  # their prompt tokens, forgotten as the fit forgets
        self.margin_s = 0.0
        # The weighted least-squares problem as its normal equations, gram @ theta =
        # moment; plain floats: at this size Python beats numpy's per-call cost.
        self._gram = [[0.0 for _ in _TERMS] for _ in _TERMS]
        self._moment = [0.0 for _ in _TERMS]
        self._theta = [0.0 for _ in _TERMS]
        self._residual_scale: float | None = None  # robust spread of residuals, seconds
        # Recent mixed steps, as (features vector, seconds): the margin's sample.
        self._mixed: deque[tuple[Vector, float]] = deque(maxlen=margin_window)

    @property
    def coefficients(self) -> Vector:
        """Seconds per unit of each term: base, decode token, prefill token, decode
        key, prefill key."""
        return tuple(theta / scale for theta, scale in zip(self._theta, _SCALES, strict=True))

    @property
    def per_prefill_key_s(self) -> float:
        """Seconds per key a prefill chunk reads (the last of the coefficients)."""
        return self._theta[-1] / _SCALES[-1]

    def predict(self, features: StepFeatures) -> float:
        """The predicted duration of a step, in seconds (without the margin)."""
        return _dot(self._theta, features.vector())

    def update(self, features: StepFeatures, seconds: float) -> None:
        """Learn from one step that took `seconds`."""
        x = features.vector()
        predicted = _dot(self._theta, x)
        weight = self._huber_weight(seconds - predicted)
        keep = self.forgetting
        for i in _TERMS:
            row = self._gram[i]
            for j in _TERMS:
                row[j] = keep * row[j] + weight * x[i] * x[j]
            self._moment[i] = keep * self._moment[i] + weight * seconds * x[i]
        self._solve()
        self._track_scale(seconds - predicted)
        self.num_steps += 1
        self.prefill_tokens = keep * self.prefill_tokens + features.prefill_tokens
        if features.prefill_tokens:
            self.prefill_steps += 1
        mixed = features.decode_tokens > 0 and features.prefill_tokens > 0
        if mixed and self.num_steps > self.warmup_steps:
            self._mixed.append((x, seconds))
            theta = self._theta
            errors = [taken - _dot(theta, vector) for vector, taken in self._mixed]
            self.margin_s = max(0.0, _quantile(errors, self.margin_quantile))

    def estimate(self) -> StepCostEstimate:
        """A snapshot of the coefficients and the margin."""
        base, decode, prefill, decode_key, prefill_key = self.coefficients
        return StepCostEstimate(
            base, decode, prefill, decode_key, prefill_key,
            margin_s=self.margin_s, num_steps=self.num_steps, prefill_tokens=self.prefill_tokens,
        )  # fmt: skip

    def _solve(self) -> None:
        """Least squares with every cost non-negative, by coordinate descent from the
        previous solution (a few sweeps per step suffice: one step moves it little).

        Without the constraint, terms that barely vary from step to step (the same
        decodes, a little more context each time) are nearly collinear, and the fit
        trades a large cost against a negative one that no other batch would obey.
        A term no recent step exercised keeps its last value.
        """
        gram, moment, theta = self._gram, self._moment, self._theta
        unexcited = 1e-9 * sum(gram[term][term] for term in _TERMS)
        for _ in range(self.sweeps):
            for term in _TERMS:
                own = gram[term][term]
                if own <= unexcited:
                    continue
                others = _dot(gram[term], theta) - own * theta[term]
                theta[term] = max(0.0, (moment[term] - others) / own)

    def _huber_weight(self, residual: float) -> float:
        """1 for ordinary residuals; less for outliers, so that each pulls the fit
        as hard as a residual of `huber_k` typical ones."""
        if self._residual_scale is None or self._residual_scale <= 0.0:
            return 1.0
        bound = self.huber_k * self._residual_scale
        return 1.0 if abs(residual) <= bound else bound / abs(residual)

    def _track_scale(self, residual: float) -> None:
        """A running mean of absolute residuals, each clipped at the Huber bound so an
        outlier cannot inflate it (it still grows if every step gets slower)."""
        size = abs(residual)
        if self._residual_scale is None:
            self._residual_scale = size
            return
        clipped = min(size, self.huber_k * self._residual_scale)
        self._residual_scale += 0.05 * (clipped - self._residual_scale)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    total: float = sum(map(operator.mul, a, b))
    return total


def _quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank from above), for a high q: found among
    the largest few rather than by sorting them all."""
    index = min(len(values) - 1, int(q * len(values)))
    return float(heapq.nlargest(len(values) - index, values)[-1])
