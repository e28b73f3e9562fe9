"""The designed sweep of engine steps behind a profile's step-cost model.

For each decode batch (a count of running decodes at a context length) the sweep
measures steps that add a prefill chunk of each size starting at each offset, and
decode-only steps: the grid spans decode tokens, prefill tokens and the keys each
attends, so that every term of the model is excited on its own. Each point is
measured a few times (its decodes a token further each time). The engine is the real
one, under the worker's flags; only each step's budget is set by the sweep.

A machine's pace drifts while the sweep runs (other processes come and go), and the
batches are measured one after another, so a drift would read as a cost of whatever
the batch measured then: in one pass in the grid's order, the later contexts and the
larger batches would take the machine's slow minutes as their own cost. So the sweep
runs in rounds, each visiting every point once, the batches and their points in an
order drawn afresh each round (seeded): a drift falls on different points in each
round, and the fit takes each point's median over the rounds (`fit`). Before and
after each batch the sweep also times one reference step (a lone prefill chunk), and
each step records the reference time beside it: the fit may bring every step to the
machine's typical pace.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.bench.config import FIRST_PROMPT_TOKEN_ID
from pdserve.workers.engine.budget import StaticBudget
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import StepSample
from pdserve.workers.plan.scenario import RoleSetup
from pdserve.workers.server.worker import torch_threads

WARM_UP_STEPS = 4
REPEAT_ROOM = 256  # tokens a repeated batch decodes before it is made again
REFERENCE_REPEATS = 3  # reference steps timed before and after each batch (the median)
BUILD_BUDGET = 512  # the least token budget a batch's prompts are prefilled under


@dataclass(frozen=True)
class SweepDesign:
    """The grid: decode contexts and counts, prefill chunk sizes and their offsets."""

    contexts: tuple[int, ...]
    decodes: tuple[int, ...]
    prefills: tuple[int, ...]
    starts: tuple[int, ...]
    repeats: int  # steps of each point per round
    together_s: float = 4.0  # workers step together this long at each level (`contention`)
    rounds: int = 1  # passes over the whole grid, each in an order of its own
    # The reference step: a lone chunk of this many prompt tokens, no decodes.
    reference_prefill: int = 64


DESIGNS = {
    "quick": SweepDesign((32, 128), (0, 4), (0, 32), (0, 64), 1, together_s=1.5, rounds=2),
    "full": SweepDesign(
        (64, 256, 1024),
        (0, 1, 4, 16, 32),
        (0, 32, 128, 512),
        (0, 512),
        1,
        together_s=6.0,
        rounds=3,
    ),
}
Batch = tuple[int, int]  # (context, decodes): the decodes a point's steps run beside


@dataclass(frozen=True)
class SweepPoint:
    """One point of the grid (a decode batch plus one prefill chunk, maybe none)."""

    context: int
    decodes: int
    prefill: int
    start: int


def design_points(design: SweepDesign, engine: LLMEngine) -> Iterator[SweepPoint]:
    """The grid's points that fit the engine: its context, its seats and its cache
    (with room for the steps the batch decodes meanwhile)."""
    capacity = engine.num_blocks * engine.block_size
    steps = decode_steps(design)
    seats = engine.config.scheduler.max_num_seqs - 1
    for context in design.contexts:
        for decodes in design.decodes:
            used = decodes * (context + steps)
            if decodes > seats or context + steps >= engine.max_model_len:
                continue
            for start in design.starts:
                for prefill in design.prefills:
                    fits = used + start + prefill + 1 <= capacity
                    inside = start + prefill + 1 < engine.max_model_len
                    # A decode-only step once per batch; prefill alone at one context.
                    useful = prefill > 0 or (decodes > 0 and start == design.starts[0])
                    once = decodes > 0 or context == design.contexts[0]
                    if fits and inside and useful and once:
                        yield SweepPoint(context, decodes, prefill, start)


def measurement_order(
    points: Sequence[SweepPoint], rounds: int, seed: int = 0
) -> list[tuple[int, Batch, list[SweepPoint]]]:
    """The order the sweep measures `points` in: `rounds` rounds, each visiting every
    batch once and each of its points, both in an order drawn for the round: (round,
    batch, its points in order)."""
    rng = np.random.default_rng(seed)
    batches = sorted({(p.context, p.decodes) for p in points})
    order = []
    for round_ in range(rounds):
        for index in rng.permutation(len(batches)):
            batch = batches[int(index)]
            mine = [p for p in points if (p.context, p.decodes) == batch]
            order.append((round_, batch, [mine[int(i)] for i in rng.permutation(len(mine))]))
    return order


def decode_steps(design: SweepDesign) -> int:
    """The most steps a decode batch runs for: while its later requests are prefilled
    (the first ones decode meanwhile), two per measurement, and a margin. A batch that
    ran out of tokens before its points were measured would measure fewer decodes."""
    building = max(
        -(-decodes * context // max(BUILD_BUDGET, context))
        for context in design.contexts
        for decodes in design.decodes
    )
    return building + 2 * len(design.prefills) * len(design.starts) * design.repeats + 16


class Sweep:
    """Runs the design on an engine and collects the measured steps."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.model_config.vocab_size
        self._ids = 0
        self._decode_room = 16  # tokens each running decode may still draw

    def run(
        self, design: SweepDesign, progress: Callable[[str], None] = lambda line: None
    ) -> list[tuple[SweepPoint, StepSample]]:
        """Every point measured `repeats` times a round, batch by batch, in the
        rounds' order (`measurement_order`)."""
        points = list(design_points(design, self.engine))
        self._decode_room = decode_steps(design)
        self._warm_up()
        samples: list[tuple[SweepPoint, StepSample]] = []
        for round_, batch, batch_points in measurement_order(points, design.rounds):
            before = self._reference_s(design)
            running = self._decoding(*batch)
            measured: list[tuple[SweepPoint, StepSample]] = []
            for point in batch_points:
                measured += [(point, self._measure(point)) for _ in range(design.repeats)]
            for request_id in running:
                self.engine.abort(request_id)
            tags = {"reference_s": (before + self._reference_s(design)) / 2, "round": round_}
            samples += [(point, sample.model_copy(update=tags)) for point, sample in measured]
            progress(f"profile: {len(samples)} steps measured (round {round_ + 1}, "
                     f"context {batch[0]}, {batch[1]} decodes)")  # fmt: skip
        return samples

    def repeat(self, point: SweepPoint, seconds: float) -> list[tuple[float, float]]:
        """The point's step, then a decode-only step of its batch, over and over for
        `seconds` of wall time: the seconds of each step of each such pair."""
        capacity = self.engine.num_blocks * self.engine.block_size
        cache_room = (capacity - point.start - point.prefill - 1) // max(1, point.decodes)
        room = min(self.engine.max_model_len - point.context - 1, cache_room - point.context)
        self._decode_room = max(4, min(REPEAT_ROOM, room))
        pairs: list[tuple[float, float]] = []
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            running = self._decoding(point.context, point.decodes)
            for _ in range(self._decode_room // 2 - 1):
                if time.perf_counter() >= until:
                    break
                chunk = self._measure(point).seconds
                pairs.append((chunk, self._measure(replace(point, prefill=0)).seconds))
            for request_id in running:
                self.engine.abort(request_id)
        return pairs

    def _warm_up(self) -> None:
        running = self._decoding(16, 2)
        for _ in range(WARM_UP_STEPS):
            self._step(8)
        for request_id in running:
            self.engine.abort(request_id)

    def _reference_s(self, design: SweepDesign) -> float:
        """The machine's pace now: the median time of the reference step, alone."""
        point = SweepPoint(0, 0, design.reference_prefill, 0)
        return statistics.median(self._measure(point).seconds for _ in range(REFERENCE_REPEATS))

    def _decoding(self, context: int, count: int) -> list[str]:
        """`count` requests of `context` prompt tokens, prefilled and decoding."""
        ids = [self._add(context, self._decode_room) for _ in range(count)]
        while any(r.is_prefilling for r in self.engine.scheduler.running) or (
            self.engine.scheduler.waiting
        ):
            self._step(max(BUILD_BUDGET, context))
        return ids

    def _measure(self, point: SweepPoint) -> StepSample:
        """One step of the point: its decodes and (if any) a prefill chunk."""
        if point.prefill == 0:
            return self._step(point.decodes)
        request_id = self._add(point.start + point.prefill + 1, 1)
        if point.start:
            self._step(point.decodes + point.start)
        sample = self._step(point.decodes + point.prefill)
        self.engine.abort(request_id)
        return sample

    def _add(self, prompt_tokens: int, max_tokens: int) -> str:
        self._ids += 1
        request_id = f"sweep-{self._ids}"
        prompt = self.rng.integers(FIRST_PROMPT_TOKEN_ID, self.vocab, prompt_tokens).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, prompt, params)
        return request_id

    def _step(self, budget: int) -> StepSample:
        """Run one step under `budget` tokens; what it computed and how long it took
        (the engine's own measure, the one its cost model learns from)."""
        self.engine.scheduler.policy = StaticBudget(budget)
        result = self.engine.step()
        features = StepFeatures.of(result.chunks)
        return StepSample(
            decode_tokens=features.decode_tokens,
            prefill_tokens=features.prefill_tokens,
            decode_keys=features.decode_keys,
            prefill_keys=features.prefill_keys,
            seconds=max(result.stats.duration_s, 1e-9),
        )


@contextlib.contextmanager
def worker_threads(setup: RoleSetup) -> Iterator[int]:
    """Compute with the torch threads a worker with these flags computes with (a
    sweep on more threads than the workers get measures another machine); yields
    their number."""
    before = torch.get_num_threads()
    threads = torch_threads(setup.options)
    torch.set_num_threads(threads or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
