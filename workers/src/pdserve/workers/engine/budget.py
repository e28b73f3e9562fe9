"""Each step's token budget: a fixed number (static), or as much prefill as the ITL
target allows (adaptive).

The scheduler asks its policy once per step, showing it the step's shape before the
budget is known: the decodes that will run and the prompts that wait for prefill, in
the order the scheduler serves them. Decodes always come first; the budget decides how
many prefill tokens join them.

The adaptive policy keeps the running decodes' inter-token latency under the target.
Their last tokens came out when the previous step ended, so this step must end within
the target of that moment: it gets the largest number of prefill tokens whose
predicted duration (the step-cost model's, plus a margin) fits in what is left. It
never goes above the ceiling. The floor is for steps the decodes alone already make
miss the target: there the target is lost whatever the budget, and a waiting prompt
still progresses by the floor, however many decodes run; a step the decodes alone
keep under the target never goes over it for the floor's sake (under a burst, the
prompts wait for room rather than stall every stream). With no decode running there
is no stream to protect and prefill takes the ceiling.

The margin is learned from the gaps themselves. It starts at the cost model's (a high
quantile of its recent errors) and a correction follows what the decodes saw on the
steps the target sized: each gap over the target raises it, each one under lowers it
by a small fraction of that, so it settles where OVER_TARGET_SHARE of those gaps run
over (stochastic quantile tracking). A model that errs more than its margin allows
(a burst of long prompts it has not seen yet) is corrected within a few steps; one
whose error quantile is too cautious gives the time back, step by step.

Nor does it go above the chunk the model predicts computes prompts fastest (tokens per
second of step). Where a step's fixed cost dominates, as on an accelerator, that is the
ceiling; where attention grows with the square of the chunk (a CPU attending a whole
chunk at once), a larger chunk takes longer per token: it would slow every prompt and
every stream and help nothing, so the policy stops at the fastest one. The rate counts
only the keys chunking adds: a chunk's tokens attend the prompt before it whatever the
chunks (a prompt of n tokens reads n(n+1)/2 keys at best), so those keys are no cost
of the chunk's size; what grows with it is the keys its tokens read of each other, as
one chunk, where smaller chunks would have read them causally, about half.

Until the model has learned from COLD_PREFILL_STEPS steps that computed prefill it
knows nothing of what attention over a chunk costs, and would take the whole ceiling
as one chunk; it takes at most COLD_CHUNK tokens meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.workers.engine.clock import Clock
from pdserve.workers.engine.config import SchedulerConfig
from pdserve.workers.engine.step_cost import StepCostModel, StepFeatures

# The share of target-sized steps whose gap may run over the target: half the 1% a P99
# allows, since the streams also see steps the budget does not size.
OVER_TARGET_SHARE = 0.005
# A gap over the target raises the margin by this share of the target; one under it
# lowers it by OVER_TARGET_SHARE / (1 - OVER_TARGET_SHARE) as much.
MARGIN_STEP = 0.05
# Bounds of the margin, as shares of the target: a model that overestimates may have
# its predictions run a little over the target.
MARGIN_BOUNDS = (-0.25, 1.0)
# A chunk the model has not yet learned enough to size (see above): the scheduler's
# default budget on a CPU, a few of an accelerator's steps.
COLD_CHUNK = 128
COLD_PREFILL_STEPS = 16


@dataclass(frozen=True)
class PrefillWork:
    """A prompt with tokens left to compute: its next chunk starts at `start`."""

    start: int
    remaining: int


@dataclass(frozen=True)
class BatchShape:
    """What the next step holds before its budget is chosen."""

    num_decodes: int
    longest_decode: int  # tokens in the cache of the longest decode, its new one included
    prefills: tuple[PrefillWork, ...] = ()  # in the order the scheduler fills them

    def features(self, prefill_tokens: int) -> StepFeatures:
        """The step's features if `prefill_tokens` prefill tokens join the decodes,
        handed out as the scheduler would: each prompt in turn, as much as it needs."""
        chunks = self._chunks(prefill_tokens)
        tokens = sum(chunk for _, chunk in chunks)
        keys = sum(chunk * (work.start + chunk) for work, chunk in chunks)
        return StepFeatures(self.num_decodes, tokens, self.num_decodes * self.longest_decode, keys)

    def chunking_features(self, prefill_tokens: int) -> StepFeatures:
        """The step's features with only the keys that chunking adds: of a chunk of n
        tokens, n(n-1)/2 (its tokens attending each other at once rather than
        causally); the keys before the chunk are read whatever the chunks."""
        chunks = self._chunks(prefill_tokens)
        tokens = sum(chunk for _, chunk in chunks)
        keys = sum(chunk * (chunk - 1) // 2 for _, chunk in chunks)
        return StepFeatures(self.num_decodes, tokens, self.num_decodes * self.longest_decode, keys)

    def _chunks(self, prefill_tokens: int) -> list[tuple[PrefillWork, int]]:
        """The prompts `prefill_tokens` would reach, each with its chunk."""
        left, chunks = prefill_tokens, []
        for work in self.prefills:
            if left <= 0:
                break
            chunk = min(left, work.remaining)
            chunks.append((work, chunk))
            left -= chunk
        return chunks


class BudgetPolicy(Protocol):
    """Chooses how many tokens each step may compute."""

    def budget(self, shape: BatchShape) -> int:
        """The token budget of the step about to be scheduled (decodes included)."""

    def step_ended(self, at: float | None) -> None:
        """A step ended at `at` (time.monotonic()) with requests still running, or
        (None) with nothing left to run."""


class StaticBudget:
    """The same budget every step: `max_num_batched_tokens`."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def budget(self, shape: BatchShape) -> int:
        """The fixed budget, whatever the step holds."""
        return self.tokens

    def step_ended(self, at: float | None) -> None:
        """Nothing to track."""


class AdaptiveBudget:
    """The most prefill whose predicted step time keeps decodes under the ITL target."""

    def __init__(
        self,
        target_s: float,
        floor: int,
        ceiling: int,
        cost: StepCostModel,
        clock: Clock = time.monotonic,
    ) -> None:
        self.target_s = target_s
        self.floor = floor
        self.ceiling = ceiling
        self.cost = cost
        self.clock = clock
        self.correction_s = 0.0  # added to the cost model's margin, from the gaps seen
        self._last_tokens_at: float | None = None
        self._sized = False  # whether the target sized the step running now

    @property
    def margin_s(self) -> float:
        """Seconds kept free of predicted work in a step: the cost model's error
        quantile, corrected by the gaps seen."""
        low, high = MARGIN_BOUNDS
        margin = self.cost.margin_s + self.correction_s
        return min(max(margin, low * self.target_s), high * self.target_s)

    def budget(self, shape: BatchShape) -> int:
        """Decodes plus the prefill tokens the target leaves room for (at most the
        ceiling in all; the floor where the decodes alone miss the target)."""
        self._sized = False
        room = self.ceiling - shape.num_decodes
        if not shape.prefills or room <= 0:
            return self.ceiling
        fastest = self._fastest(shape, room)
        if shape.num_decodes == 0:
            return max(fastest, min(self.floor, room))
        left_s = self.target_s - self._elapsed()
        if self.cost.predict(shape.features(0)) > left_s:
            return shape.num_decodes + min(self.floor, room)  # the target is lost anyway
        fitting = self._largest_fit(shape, room, left_s - self.margin_s)
        self._sized = fitting < min(fastest, room)
        return shape.num_decodes + min(fitting, fastest)

    def step_ended(self, at: float | None) -> None:
        """Remember when the running decodes last got a token; if the target sized
        the step, move the margin's correction by whether its gap ran over."""
        if self._sized and at is not None and self._last_tokens_at is not None:
            over = at - self._last_tokens_at > self.target_s
            step = MARGIN_STEP * self.target_s
            if over:
                self.correction_s += step
            else:
                self.correction_s -= step * OVER_TARGET_SHARE / (1 - OVER_TARGET_SHARE)
            low, high = MARGIN_BOUNDS  # no further than the margin's own bounds
            base = self.cost.margin_s
            self.correction_s = min(
                max(self.correction_s, low * self.target_s - base), high * self.target_s - base
            )
        self._sized = False
        self._last_tokens_at = at

    def _elapsed(self) -> float:
        """Seconds since the running decodes' last tokens came out."""
        if self._last_tokens_at is None:
            return 0.0
        return max(0.0, self.clock() - self._last_tokens_at)

    def _fastest(self, shape: BatchShape, room: int) -> int:
        """The prefill tokens, up to `room`, that the model predicts are computed at the
        highest rate (tokens per second of step, the keys before each chunk left out).
        The rate rises while the step's fixed cost dominates and falls once the chunk's
        attention does (the predicted time is convex in the tokens), so a ternary search
        finds its peak; a model that has learned from too few prefill steps gets
        COLD_CHUNK."""
        if self.cost.prefill_steps < COLD_PREFILL_STEPS:
            return min(room, COLD_CHUNK)
        if self.cost.predict(shape.chunking_features(room)) <= 0:
            return room

        def rate(tokens: int) -> float:
            features = shape.chunking_features(tokens)  # prompts may need fewer
            return features.prefill_tokens / max(self.cost.predict(features), 1e-12)

        low, high = 1, room  # the peak lies in [low, high]; ties go to the larger chunk
        while high - low > 2:
            third = (high - low) // 3
            if rate(low + third) <= rate(high - third):
                low = low + third + 1
            else:
                high = high - third
        return max(range(low, high + 1), key=lambda tokens: (rate(tokens), tokens))

    def _largest_fit(self, shape: BatchShape, room: int, allowed_s: float) -> int:
        """The most prefill tokens, up to `room`, whose predicted step fits in
        `allowed_s`. The prediction grows with the tokens, so a bisection finds it."""

        def fits(tokens: int) -> bool:
            return self.cost.predict(shape.features(tokens)) <= allowed_s

        if fits(room):
            return room
        low, high = 0, room  # fits(low) or low == 0; not fits(high)
        if not fits(low):
            return 0
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low


def static_budget(config: SchedulerConfig, max_model_len: int) -> int:
    """The fixed budget: `max_num_batched_tokens`, and without chunking at least the
    model's context, since a whole prompt must then fit in one step."""
    if not config.enable_chunked_prefill:
        return max(config.max_num_batched_tokens, max_model_len)
    return config.max_num_batched_tokens


def budget_policy(
    config: SchedulerConfig, max_model_len: int, cost: StepCostModel, clock: Clock = time.monotonic
) -> BudgetPolicy:
    """The policy `config` asks for; an adaptive one predicts with `cost`, which its
    owner teaches after every step, and reads the time from `clock`."""
    budget = config.token_budget
    if budget.mode == "adaptive":
        assert budget.target_itl_s is not None  # checked by TokenBudgetConfig
        return AdaptiveBudget(
            budget.target_itl_s, budget.min_budget, config.budget_ceiling, cost, clock
        )
    return StaticBudget(static_budget(config, max_model_len))
