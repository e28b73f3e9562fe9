"""Each step's token budget: a fixed number (static), or as much prefill as the ITL
target allows (adaptive).

The scheduler asks its policy once per step, showing it the step's shape before the
budget is known: the decodes that will run and the prompts that wait for prefill, in
the order the scheduler serves them. Decodes always come first; the budget decides how
many prefill tokens join them.

The adaptive policy keeps the running decodes' inter-token latency under the target.
Their last tokens came out when the previous step ended, so this step must end within
the target of that moment: it gets the largest number of prefill tokens whose
predicted duration (the step-cost model's, plus its learned margin) fits in what is
left. It never goes above the ceiling, and while a prompt waits it always gives at
least the floor, so a long prompt progresses however many decodes run. With no decode
running there is no stream to protect and prefill takes the ceiling.

Nor does it go above the chunk the model predicts computes prompts fastest (tokens per
second of step). Where a step's fixed cost dominates, as on an accelerator, that is the
ceiling; where attention grows with the square of the chunk (a CPU attending a whole
chunk at once), a larger chunk takes longer per token: it would slow every prompt and
every stream and help nothing, so the policy stops at the fastest one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.workers.engine.clock import Clock
from pdserve.workers.engine.config import SchedulerConfig
from pdserve.workers.engine.step_cost import StepCostModel, StepFeatures


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
        left, tokens, keys = prefill_tokens, 0, 0
        for work in self.prefills:
            if left <= 0:
                break
            chunk = min(left, work.remaining)
            tokens += chunk
            keys += chunk * (work.start + chunk)
            left -= chunk
        return StepFeatures(self.num_decodes, tokens, self.num_decodes * self.longest_decode, keys)


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
        self._last_tokens_at: float | None = None

    def budget(self, shape: BatchShape) -> int:
        """Decodes plus the prefill tokens the target leaves room for (at least the
        floor, at most the ceiling in all)."""
        room = self.ceiling - shape.num_decodes
        if not shape.prefills or room <= 0:
            return self.ceiling
        fastest = self._fastest(shape, room)
        if shape.num_decodes == 0:
            return max(fastest, min(self.floor, room))
        allowed_s = self.target_s - self._elapsed() - self.cost.margin_s
        fitting = min(self._largest_fit(shape, room, allowed_s), fastest)
        return shape.num_decodes + max(fitting, min(self.floor, room))

    def step_ended(self, at: float | None) -> None:
        """Remember when the running decodes last got a token."""
        self._last_tokens_at = at

    def _elapsed(self) -> float:
        """Seconds since the running decodes' last tokens came out."""
        if self._last_tokens_at is None:
            return 0.0
        return max(0.0, self.clock() - self._last_tokens_at)

    def _fastest(self, shape: BatchShape, room: int) -> int:
        """The prefill tokens, up to `room`, that the model predicts are computed at the
        highest rate (tokens per second of step). The rate rises while the step's fixed
        cost dominates and falls once the chunk's attention does (the predicted time is
        convex in the tokens), so a ternary search finds its peak; a model that has
        learned nothing yet predicts no cost, and the answer is `room`."""

        if self.cost.predict(shape.features(room)) <= 0:
            return room

        def rate(tokens: int) -> float:
            features = shape.features(tokens)  # prompts may need fewer than `tokens`
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
