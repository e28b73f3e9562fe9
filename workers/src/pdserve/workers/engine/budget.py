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
still progresses by the floor, however many decodes run. A step the decodes alone keep
under the target never goes over it for the floor's sake, but nor does a prompt starve
behind decodes that leave less room than the margin: it gets up to the floor of what
fits under the target with half the margin (under a burst, prompts progress slowly
rather than stall every stream, or wait for every long stream to end). With no decode
running there is no stream to protect and prefill takes the ceiling.

The margin is learned from the gaps themselves: how far each recent step that ran
decodes beside waiting prompts ran past what was predicted of its gap (the time
already gone when it was sized, plus the model's prediction of the step), and the
margin is the (1 - OVER_TARGET_SHARE) quantile of those overruns over the last
GAP_WINDOW such steps (never their largest: a step may run over once in a window).
It holds everything that makes a stream wait that the model does not see (the
server's own work between steps, other processes on the cores, the model's own
errors), once, and follows them both ways: a burst of slow steps raises it within a
few steps, and it falls once they leave the window. Until MIN_GAPS such steps
have been seen it is the cost model's (a high quantile of its own errors).

Nor does it go above the chunk the model predicts computes prompts fastest (tokens per
second of step). Where a step's fixed cost dominates, as on an accelerator, that is the
ceiling; where attention grows with the square of the chunk (a CPU attending a whole
chunk at once), a larger chunk takes longer per token: it would slow every prompt and
every stream and help nothing, so the policy stops at the fastest one. The rate counts
only the keys chunking adds: a chunk's tokens attend the prompt before it whatever the
chunks (a prompt of n tokens reads n(n+1)/2 keys at best), so those keys are no cost
of the chunk's size; what grows with it is the keys its tokens read of each other, as
one chunk, where smaller chunks would have read them causally, about half. With no
decode running, a chunk that would stop a little short of a prompt's end runs on to it
where one step is predicted to finish the prompt sooner than two (`_fastest`).

Until the model has learned from COLD_PREFILL_STEPS steps that computed prefill it
knows nothing of what attention over a chunk costs, and would take the whole ceiling
as one chunk. Beside decodes it takes at most COLD_CHUNK tokens meanwhile. With no
decode running a step's size delays no stream, so the cold chunks there serve the
prompt and the fit: they take COLD_CHUNKS in turn. The small one alone computes prompts
slowest on a CPU (a 2,048-token prompt alone on the tiny model, one thread: about 4,800
prompt tokens/s in 128-token chunks, 6,000-6,500 in 256-512), and one size every step
teaches the model nothing of how a step's time grows with its chunk: its fixed cost and
its cost per token cannot be told apart, and the fastest chunk it then predicts is
anything (taught by 128-token chunks alone: 170-850 tokens, by the three sizes:
450-550, where the measured optimum is 256-512). A cold chunk that would stop inside a
prompt whose rest is within one more cold chunk runs to its end: split in two, a short
prompt's first token would come a whole step later for the model's sake (beside
decodes, every prompt of 129-256 tokens in a fresh worker's first 16 prefill steps: in
the simulator with exact costs, the mixed shape's first requests' TTFT rose 15-30% and
its TTFT P50 up to 5% over a static 512's). The step stays within twice the cold chunk,
and beside decodes within what the target allows.

A step is sized for itself, but a prompt it finishes decodes in every step after it,
and its context adds to every decode step's keys. So a step does not finish a prompt
whose joining would make the decodes' steps alone run past the target (less the
margin): its chunk stops two tokens short, and it finishes once streams have ended
(`_joining_fits`). Under overload that is the admission a stream's target needs: in the
simulator's load step, with decodes padded to the longest in one call, one 2,700-token
prompt joining 60 short streams took their steps alone from 52 to 220 ms (decodes are
now attended in groups of similar length, which makes such a join far cheaper, and the
rule fires accordingly less).

The margin above sizes each step sized beside prompts as if it alone had to keep the
target; but the P99 ITL a user measures is over every gap of every stream, those of
steps with no prompt waiting included, so a margin that keeps OVER_TARGET_SHARE of
the sized steps under the target keeps the streams' P99 well under it (11-21% under,
measured), and prompts wait for it. So the margin is corrected by what the streams
saw (`GapFeedback`, closed loop): each gap between a stream's tokens, counted once per
stream that waited on it, in a window of recent steps; while the window's
(1 - OVER_TARGET_SHARE) quantile of those gaps lies under the target, the correction
falls by a share of the room left (an integral term: it settles where the quantile
meets the target, which is where the best static budget sits), and each step whose
gap ran over the target raises it at once by a fixed step (the fast back-off). The
model's prediction and its overrun margin stay the feed-forward part: they size each
step for its own shape; the correction only moves where they aim.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import Any, Protocol, TypeVar

from pdserve.workers.engine.clock import Clock
from pdserve.workers.engine.config import SchedulerConfig
from pdserve.workers.engine.decode_groups import attended_keys
from pdserve.workers.engine.step_cost import StepCostModel, StepFeatures

# Each decision of the adaptive budget, at DEBUG: what it saw and what it chose.
decision_log = logging.getLogger("pdserve.workers.engine.budget")

# The share of the gaps the target sizes that may run over it: half the 1% a P99 ITL
# allows, since the client sees the streams' tokens a little later than the engine
# (the server's delivery), and not always equally late.
OVER_TARGET_SHARE = 0.005
# The overruns the margin is a quantile of, and how many it needs before it is used.
GAP_WINDOW = 256
MIN_GAPS = 16
# Bounds of the margin, as shares of the target: a model that overestimates may have
# its predictions run a little over the target.
MARGIN_BOUNDS = (-0.25, 1.0)
# A chunk the model has not yet learned enough to size (see above): the scheduler's
# default budget on a CPU, a few of an accelerator's steps.
COLD_CHUNK = 128
COLD_CHUNKS = (COLD_CHUNK, 2 * COLD_CHUNK, 4 * COLD_CHUNK)
COLD_PREFILL_STEPS = 16
# The closed loop (`GapFeedback`): the steps with decodes whose gaps it watches; the
# share of the room left under the target its correction gives back per step; the
# step it takes back at once when a gap runs over the target, and its bounds, as
# shares of the target.
FEEDBACK_WINDOW = 256
FEEDBACK_GAIN = 0.02
FEEDBACK_BACKOFF = 0.05
FEEDBACK_BOUNDS = (-0.25, 0.5)


P = TypeVar("P")
# What a prompt still needs, for `fill_prompts`: the policy's `PrefillWork` and the
# scheduler's prompts both name it so.
REMAINING: Callable[[Any], int] = attrgetter("remaining")


def fill_prompts(
    prompts: Iterable[P],
    remaining: Callable[[P], int],
    budget: int,
    first_tokens_alone: bool,
    admits: Callable[[P, int], bool] | None = None,
) -> Iterator[tuple[P, int]]:
    """Each prompt's chunk as a step fills them, in the order given: each as much as it
    needs (`remaining`) in turn while the `budget` of tokens lasts. With
    `first_tokens_alone`, once a prompt's last tokens are in the step, only prompts
    whose last tokens also fit join it: a first token does not wait for part of a
    longer prompt (the scheduler's shortest-first order). `admits(prompt, left)` may
    pass a prompt over, with `left` tokens of the budget still to give; it then takes
    nothing. The scheduler plans its steps with this, and the budget policy's view of
    a step (`BatchShape`) predicts them with it, so the two cannot drift apart."""
    left = budget
    completed = False  # a prompt's last tokens are in the step
    for prompt in prompts:
        if left <= 0:
            return
        need = remaining(prompt)
        if completed and first_tokens_alone and need > left:
            continue
        if admits is not None and not admits(prompt, left):
            continue
        chunk = min(need, left)
        yield prompt, chunk
        completed = completed or chunk == need
        left -= chunk


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
    # Whether the step is filled with the first tokens alone (`fill_prompts`): the
    # scheduler's shortest-first order.
    first_tokens_alone: bool = False
    # Each decode's tokens in the cache, its new one included (empty: all as long as
    # the longest).
    decode_lens: tuple[int, ...] = ()

    def decode_contexts(self, grown: int = 0) -> list[int]:
        """Each decode's context, `grown` tokens on."""
        lens = self.decode_lens or (self.longest_decode,) * self.num_decodes
        return [length + grown for length in lens]

    @cached_property  # read by every size the policy tries for the step
    def decode_keys(self) -> int:
        """The keys the decodes read (attended in groups of similar length)."""
        return attended_keys(self.decode_contexts())

    @property
    def prefill_tokens(self) -> int:
        """The prefill tokens the waiting prompts need in all."""
        return sum(work.remaining for work in self.prefills)

    def features(self, prefill_tokens: int) -> StepFeatures:
        """The step's features if `prefill_tokens` prefill tokens join the decodes,
        handed out as the scheduler would: each prompt in turn, as much as it needs."""
        chunks = self._chunks(prefill_tokens)
        tokens = sum(chunk for _, chunk in chunks)
        keys = sum(chunk * (work.start + chunk) for work, chunk in chunks)
        return StepFeatures(self.num_decodes, tokens, self.decode_keys, keys)

    def chunking_features(self, prefill_tokens: int) -> StepFeatures:
        """The step's features with only the keys that chunking adds: of a chunk of n
        tokens, n(n-1)/2 (its tokens attending each other at once rather than
        causally); the keys before the chunk are read whatever the chunks."""
        chunks = self._chunks(prefill_tokens)
        tokens = sum(chunk for _, chunk in chunks)
        keys = sum(chunk * (chunk - 1) // 2 for _, chunk in chunks)
        return StepFeatures(self.num_decodes, tokens, self.decode_keys, keys)

    def _chunks(self, prefill_tokens: int) -> list[tuple[PrefillWork, int]]:
        """The prompts `prefill_tokens` would reach, each with its chunk."""
        return list(fill_prompts(self.prefills, REMAINING, prefill_tokens, self.first_tokens_alone))


class GapFeedback:
    """The margin's correction from the gaps the streams saw (see the module's
    docstring): seconds added to the margin, negative where the streams keep the target
    with room to spare."""

    def __init__(self, target_s: float) -> None:
        self.target_s = target_s
        self.offset_s = 0.0
        # (gap seconds, streams that waited on it) of recent steps that ran decodes, in
        # their order and sorted (kept so as each comes and goes: the quantile is read
        # on every step the target limits), and the streams of all of them.
        self._gaps: deque[tuple[float, int]] = deque(maxlen=FEEDBACK_WINDOW)
        self._sorted: list[tuple[float, int]] = []
        self._streams = 0

    def observe(self, gap_s: float, streams: int, sized: bool, limited: bool) -> None:
        """A step ended `gap_s` after the previous one, and `streams` decodes waited
        on it. If the margin sized it (`sized`: prompts waited and the decodes alone
        left room under the target), back off at once if it ran over the target; if
        the target, not the prompts or the fastest chunk, `limited` its prefill, give
        back a share of the room the recent gaps leave under the target. Other steps
        only count in the window: the margin did not decide them, and a correction
        that moved on them would wind up (fall for a whole quiet stretch of decodes
        alone and overrun the first prompts after it)."""
        if streams <= 0:
            return
        if len(self._gaps) == FEEDBACK_WINDOW:  # the oldest leaves the window
            oldest = self._gaps[0]
            del self._sorted[bisect_left(self._sorted, oldest)]
            self._streams -= oldest[1]
        self._gaps.append((gap_s, streams))
        insort(self._sorted, (gap_s, streams))
        self._streams += streams
        if sized and gap_s > self.target_s:
            self.offset_s += FEEDBACK_BACKOFF * self.target_s
        elif limited:
            room = self.target_s - self.quantile_s()
            if room > 0:
                self.offset_s -= FEEDBACK_GAIN * room
        low, high = FEEDBACK_BOUNDS
        self.offset_s = min(max(self.offset_s, low * self.target_s), high * self.target_s)

    def quantile_s(self) -> float:
        """The (1 - OVER_TARGET_SHARE) quantile of the recent streams' gaps, each gap
        counted once per stream that waited on it (0 before any)."""
        above = OVER_TARGET_SHARE * self._streams  # the stream gaps allowed over it
        counted = 0
        for gap, streams in reversed(self._sorted):
            counted += streams
            if counted > above:
                return gap
        return 0.0


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
        # How far recent gaps ran past their predictions, seconds (see the margin).
        self._overruns: deque[float] = deque(maxlen=GAP_WINDOW)
        self._last_tokens_at: float | None = None
        # The gap predicted for the step running now, if it ran decodes beside prompts.
        self._predicted_gap: float | None = None
        # The decodes of the step running now: the streams waiting on its end; whether
        # the margin sized it, and whether the target limited its prefill.
        self._streams = 0
        self._sized = self._limited = False
        self.feedback = GapFeedback(target_s)

    @property
    def margin_s(self) -> float:
        """Seconds kept free of predicted work in a step: a high quantile of how far
        recent gaps ran past their predictions (the cost model's error quantile until
        MIN_GAPS are known), corrected by what the streams saw (`GapFeedback`), within
        MARGIN_BOUNDS of the target."""
        low, high = MARGIN_BOUNDS
        margin = self.overrun_margin_s + self.feedback.offset_s
        return min(max(margin, low * self.target_s), high * self.target_s)

    @property
    def overrun_margin_s(self) -> float:
        """The margin's feed-forward part: the (1 - OVER_TARGET_SHARE) quantile of how
        far recent sized gaps ran past their predictions (the cost model's error
        quantile until MIN_GAPS are known)."""
        if len(self._overruns) < MIN_GAPS:
            return self.cost.margin_s
        return _upper_quantile(self._overruns, OVER_TARGET_SHARE)

    def budget(self, shape: BatchShape) -> int:
        """Decodes plus the prefill tokens the target leaves room for (at most the
        ceiling in all; the floor where the decodes alone miss the target, and up to it
        within the target where they leave less room than the margin)."""
        self._predicted_gap = None
        self._streams = shape.num_decodes
        self._sized = self._limited = False
        room = self.ceiling - shape.num_decodes
        if not shape.prefills or room <= 0:
            return self.ceiling
        fastest = self._fastest(shape, room)
        if shape.num_decodes == 0:
            prefill = max(fastest, min(self.floor, room))
            prefill = self._joining_fits(shape, prefill, self.target_s - self.margin_s)
            self._log(shape, 0.0, 0.0, fastest, prefill)
            return prefill
        elapsed = self._elapsed()
        left_s = self.target_s - elapsed
        margin = self.margin_s
        if self.cost.predict(shape.features(0)) > left_s:
            prefill = min(self.floor, room)  # the target is lost anyway
        else:
            fit = self._largest_fit(shape, room, left_s - margin)
            self._sized, self._limited = True, fit < min(fastest, shape.prefill_tokens, room)
            prefill = min(fit, fastest)
            if prefill < self.floor:  # progress, within the target
                # Half the margin, and no more of it for the closed loop's back-off: a
                # burst's overruns are stalls a smaller step does not avoid.
                kept = min(margin, self.overrun_margin_s) / 2
                progress = self._largest_fit(shape, min(self.floor, room), left_s - kept)
                prefill = max(prefill, progress)
        prefill = self._joining_fits(shape, prefill, self.target_s - margin)
        self._predicted_gap = elapsed + self.cost.predict(shape.features(prefill))
        self._log(shape, elapsed, margin, fastest, prefill)
        return shape.num_decodes + prefill

    def step_ended(self, at: float | None) -> None:
        """Remember when the running decodes last got a token; if the step ran them
        beside prompts, how far their gap ran past its prediction; if it ran any, the
        gap they saw (the closed loop)."""
        last, predicted = self._last_tokens_at, self._predicted_gap
        if at is not None and last is not None:
            if predicted is not None:
                self._overruns.append(at - last - predicted)
            self.feedback.observe(at - last, self._streams, self._sized, self._limited)
        self._predicted_gap = None
        self._streams = 0
        self._sized = self._limited = False
        self._last_tokens_at = at

    def _joining_fits(self, shape: BatchShape, prefill: int, allowed_s: float) -> int:
        """`prefill`, cut two tokens short of the end of the first prompt whose last
        tokens it holds if that prompt, joining the decodes, would make their steps
        alone predicted longer than `allowed_s` (the target less the margin; see the
        module's docstring). Held there, the prompt finishes once the decodes leave it
        room; the prompts after it wait too (the scheduler fills in order), which is the
        admission a stream's target asks for under overload. Two tokens short: a chunk
        of one token takes the runner's decode path, whose cost is the decodes' (a
        prompt held one short sent a 60-stream step 47 ms past its prediction). A
        prompt finishing beside no decode joins nothing that is already late."""
        contexts, before = shape.decode_contexts(1), 0
        for work, chunk in shape._chunks(prefill):
            if chunk == work.remaining:  # it samples its first token and joins
                joined = [*contexts, work.start + work.remaining + 1]
                features = StepFeatures(len(joined), 0, attended_keys(joined), 0)
                if contexts and self.cost.predict(features) > allowed_s:
                    return before + max(chunk - 2, 0)
                contexts = joined
            before += chunk
        return prefill

    def _log(
        self, shape: BatchShape, elapsed: float, margin: float, fastest: int, prefill: int
    ) -> None:
        """The decision at DEBUG, for a user tuning the target."""
        if decision_log.isEnabledFor(logging.DEBUG):
            decision_log.debug(
                "decodes=%d longest=%d elapsed=%.1fms decodes_alone=%.1fms margin=%.1fms "
                "feedback=%.1fms fastest=%d prefill=%d predicted_gap=%.1fms",
                shape.num_decodes, shape.longest_decode, 1e3 * elapsed,
                1e3 * self.cost.predict(shape.features(0)), 1e3 * margin,
                1e3 * self.feedback.offset_s, fastest, prefill,
                1e3 * (self._predicted_gap or 0.0),
            )  # fmt: skip

    def _elapsed(self) -> float:
        """Seconds since the running decodes' last tokens came out."""
        if self._last_tokens_at is None:
            return 0.0
        return max(0.0, self.clock() - self._last_tokens_at)

    def _fastest(self, shape: BatchShape, room: int) -> int:
        """The prefill tokens, up to `room`, that the model predicts are computed at the
        highest rate (`_peak`). With no decode running (no stream waits on the step),
        run on to the end of the prompt they stop inside where one step is predicted to
        finish it sooner than two: its first token does not wait a step for a rate a
        few keys better. Beside decodes the step stays at the peak, which bounds what
        the streams wait (run on there, the burst's P99 ITL rose from 191 to 197 ms of
        its 200 in the simulator). A model that has learned from too few prefill steps
        gets COLD_CHUNK beside decodes, the next of COLD_CHUNKS without, run on to the
        end of a prompt within twice that."""
        learned = self.cost.prefill_steps
        if learned < COLD_PREFILL_STEPS:
            cold = COLD_CHUNKS[learned % len(COLD_CHUNKS)] if not shape.num_decodes else COLD_CHUNK
            return _to_prompt_end(shape, min(room, cold), min(room, 2 * cold))
        peak = self._peak(shape, room)
        end = _to_prompt_end(shape, peak, room)
        if end > peak and not shape.num_decodes and self._sooner_in_one(shape, peak, end):
            return end
        return peak

    def _sooner_in_one(self, shape: BatchShape, tokens: int, end: int) -> bool:
        """Whether a step of `end` prefill tokens, which finishes the prompt a step of
        `tokens` stops inside, is predicted to end no later than that step and the next
        one, of the decodes and the prompt's rest. One step saves the fixed cost and the
        decodes of the second; two save the keys the rest reads of the first part's
        tokens within the step, which the next step reads from the cache the same."""
        work, _ = shape._chunks(tokens)[-1]
        rest, decodes = end - tokens, shape.num_decodes
        keys = rest * (work.start + work.remaining)
        second = StepFeatures(decodes, rest, attended_keys(shape.decode_contexts(1)), keys)
        one = self.cost.predict(shape.features(end))
        return one <= self.cost.predict(shape.features(tokens)) + self.cost.predict(second)

    def _peak(self, shape: BatchShape, room: int) -> int:
        """The prefill tokens, up to `room`, at the highest predicted rate (tokens per
        second of step, the keys before each chunk left out). The rate rises while the
        step's fixed cost dominates and falls once the chunk's attention does (the
        predicted time is convex in the tokens): for one prompt its peak has a closed
        form, for several a ternary search finds it."""
        if self.cost.predict(shape.chunking_features(room)) <= 0:
            return room

        def rate(tokens: int) -> float:
            features = shape.chunking_features(tokens)  # prompts may need fewer
            return features.prefill_tokens / max(self.cost.predict(features), 1e-12)

        if len(shape.prefills) == 1:
            # One prompt (most steps): a chunk of n takes fixed + a n + b n(n-1)/2, whose
            # rate peaks at n = sqrt(2 fixed / b). The search below costs ~40 predictions,
            # 150-300 us of the step that gives a short prompt its first token.
            need = min(shape.prefills[0].remaining, room)
            fixed = max(self.cost.predict(shape.chunking_features(0)), 0.0)
            per_key = self.cost.per_prefill_key_s
            if per_key <= 0 or 2 * fixed >= per_key * need * need:
                return room  # the rate still rises where the prompt ends: ties go larger
            peak = math.sqrt(2 * fixed / per_key)
            near = {min(max(1, bound(peak)), need) for bound in (math.floor, math.ceil)}
            return max(near, key=lambda tokens: (rate(tokens), tokens))
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


def _to_prompt_end(shape: BatchShape, tokens: int, limit: int) -> int:
    """`tokens` of prefill, or, where their last chunk stops inside a prompt whose end
    lies within `limit` tokens in all, the tokens that finish it."""
    chunks = shape._chunks(tokens)
    if not chunks:
        return tokens
    work, chunk = chunks[-1]
    end = tokens + work.remaining - chunk
    return end if tokens < end <= limit else tokens


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


def _upper_quantile(values: deque[float], share: float) -> float:
    """The value that `share` of `values` exceed (nearest rank from above), found among
    the largest few; never the largest, so that one stall (the process descheduled, a
    page fault) cannot hold the budget down for a whole window on its own."""
    above = max(1, int(share * len(values)))
    return heapq.nlargest(above + 1, values)[-1]
