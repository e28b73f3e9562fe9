"""A runner that computes nothing: each step takes the time the profile predicts for
it (its compute, slower where it carries a prompt's chunk, and what serving adds per
step and per token streamed), on the worker's simulated clock (stretched by its host's
contention where it shares cores: `hosts`) and drawn from the spread a serving
worker's steps showed (`ServingOverhead.drawn_spread`, with the worker's own fixed
seed; a step longer than those it was measured on draws as several of them),
and every request that reaches the end of its tokens draws one token. The engine
around it (scheduler, budget, KV cache, leases, fork and finish) is the real one."""

from __future__ import annotations

import random

import torch

from pdserve.workers.engine.config import EngineConfig, ModelConfig
from pdserve.workers.engine.request import Request
from pdserve.workers.engine.runner import BlockTables, RunnerFactory, StepOutput
from pdserve.workers.engine.sampler import Sampled
from pdserve.workers.engine.scheduler import SchedulerOutput
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import ServingOverhead, StepCost
from pdserve.workers.plan.events import SimClock
from pdserve.workers.plan.hosts import Pace

# What a simulated request draws: any token that ends nothing (requests replayed from
# a trace ignore end-of-sequence, as `pdserve bench` asks).
DRAWN_TOKEN = 3


class SimulatedRunner:
    """The `StepRunner` of a simulated worker."""

    def __init__(
        self,
        clock: SimClock,
        cost: StepCost,
        serving: ServingOverhead,
        pace: Pace | None,
        seed: str = "",
    ) -> None:
        self.clock = clock
        self.cost = cost
        self.serving = serving
        self.pace = pace  # None: the worker has its cores to itself
        self.rng = random.Random(seed)
        self.spread = serving.drawn_spread(cost)
        self.kv_cache = torch.empty(0)  # no KV is computed, so none is held

    def execute(self, output: SchedulerOutput, block_tables: BlockTables) -> StepOutput:
        """Advance the clock by the step's predicted time; one token for each chunk
        that completes its request's tokens (n for a request that forks, none for one
        that samples nothing)."""
        sampled: list[tuple[Request, Sampled]] = []
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            request = chunk.request
            draws = (request.params.n if request.forks else 1) if request.samples else 0
            sampled.append((request, Sampled([DRAWN_TOKEN] * draws)))
        streamed = sum(len(drawn.tokens) for _, drawn in sampled)
        features = StepFeatures.of(output.chunks)
        compute = self.serving.compute(features, self.cost)
        predicted_s = compute + self.serving.seconds(streamed)
        alone_s = predicted_s * self.spread.draw(self.rng, predicted_s)
        if self.pace is not None:
            alone_s = self.pace(self.clock.now, alone_s, features.prefill_tokens > 0)
        self.clock.advance(alone_s)
        return StepOutput(sampled, [])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Nothing to copy: no KV is held."""


def runner_factory(
    clock: SimClock,
    cost: StepCost,
    serving: ServingOverhead,
    pace: Pace | None = None,
    seed: str = "",
) -> RunnerFactory:
    """The engine's `runner` argument for a worker on `clock`, at `pace` on its host,
    drawing its steps' spread with `seed`."""

    def build(
        config: EngineConfig, model: ModelConfig, num_blocks: int, block_size: int
    ) -> SimulatedRunner:
        return SimulatedRunner(clock, cost, serving, pace, seed)

    return build
