"""The contention a pool's workers step under on a machine they share with the router
and the load generator, measured on the profile's pair.

Two bare workers stepping together barely slow each other (`contention`), yet a
pool's steps run well beyond the profile's: beside its workers run the router, which
relays every request and token and follows the workers' KV feeds, and the client
driving them. Here the decode worker's streams decode in two phases, in rounds: busy
alone (the router idle, the prefill worker idle), and as a pool runs (the bench's
load generator sending requests through the router, and prompts handed over from
the prefill worker, so both workers step and the router relays and follows both
feeds). The decode-only steps of each phase, from the worker's step log, each over
the step-cost model's compute of it, give a typical ratio; the pool phase's over the
lone one's in the same round is that round's slowdown, and the median over rounds is
the level kept (`costs.Contention.pool`), with the processes busy in it. Steps that
carry a prompt's chunk are measured alike, apart (`Contention.pool_prompt`): in both
phases the decode worker is also sent prompts of its own to compute, one at a time
(the pool need not slow a chunk's compute as it slows a decode step's)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.base.process import ServerProcess
from pdserve.workers.bench.config import FIRST_PROMPT_TOKEN_ID
from pdserve.workers.plan.clients import route_run, stream_times
from pdserve.workers.plan.costs import Spread, StepCost
from pdserve.workers.plan.fit import median_difference
from pdserve.workers.plan.step_log import LoggedStep, read_steps_from

ROUNDS = 3
STREAMS = 4  # streams decoding on the decode worker in both phases
STREAM_PROMPT_TOKENS = 32
STREAM_OUTPUT_TOKENS = 96
HANDED_PROMPT_TOKENS = 128  # each prompt the prefill worker computes and hands over
ANSWER_TOKENS = 32  # the most tokens each of the load generator's requests asks for
WARM_UP_S = 0.5
ALONE_S = 3.0  # about as long as the load generator's run
SLACK_S = 0.2  # the last step's lines reach the log
# Busy in the pool phase: the two workers, the router and the load generator.
POOL_PROCESSES = 4
# A step with a chunk of at least this many tokens is one of the prompts sent to the
# decode worker (HANDED_PROMPT_TOKENS each); the load generator's are shorter
# (`clients.PROMPT_TOKENS`).
PROMPT_STEP_TOKENS = 96

Levels = tuple[tuple[int, float], ...]


def typical_ratio(
    steps: Sequence[LoggedStep], cost: StepCost, prompt: bool = False
) -> float | None:
    """The median of the decode-only steps' time over the step-cost model's compute,
    or of the steps' that carry a prompt's chunk of at least PROMPT_STEP_TOKENS
    (`prompt`); None: no such step."""
    ratios = [
        step.took_s / cost.seconds(step.features)
        for step in steps
        if (step.longest_chunk >= PROMPT_STEP_TOKENS if prompt else step.longest_chunk == 1)
        and cost.seconds(step.features) > 0
    ]
    return statistics.median(ratios) if ratios else None


@dataclass(frozen=True)
class PoolLevels:
    """The levels kept for each kind of step (one process busy, none slowed; the
    pool's, its median slowdown over the rounds; only the former where no round had
    both phases' steps of the kind), and the rounds: each kind's slowdown, and its
    steps' typical ratio to the model in each phase; and the pool phase's prompt
    steps' ratio to the model (`costs.Contention.pool_prompt_over_model`)."""

    decode: Levels
    prompt: Levels
    spreads: dict[str, Spread]
    # The pool phase's prompt steps over the model, the median over the rounds (None:
    # no round had such steps).
    prompt_over_model: float | None = None


def pool_level(
    rounds: Sequence[tuple[Sequence[LoggedStep], Sequence[LoggedStep]]], cost: StepCost
) -> PoolLevels:
    """The levels from each round's (lone, pool) phases' steps, for each kind."""
    levels: dict[bool, Levels] = {}
    spreads: dict[str, Spread] = {}
    prompt_over_model = None
    for prompt, name in ((False, "pool_slowdown"), (True, "pool_prompt_slowdown")):
        slowdowns, lone_ratios, pool_ratios = [], [], []
        for alone, pool in rounds:
            lone, busy = typical_ratio(alone, cost, prompt), typical_ratio(pool, cost, prompt)
            lone_ratios += [lone] if lone else []
            pool_ratios += [busy] if busy else []
            if lone and busy:
                slowdowns.append(busy / lone)
        kind = "prompt" if prompt else "decode"
        spreads[f"contention.{name}"] = Spread(rounds=tuple(slowdowns))
        spreads[f"contention.pool_phase.lone_{kind}_over_model"] = Spread(rounds=tuple(lone_ratios))
        spreads[f"contention.pool_phase.pool_{kind}_over_model"] = Spread(rounds=tuple(pool_ratios))
        levels[prompt] = ((1, 1.0),)
        if slowdowns:
            levels[prompt] += ((POOL_PROCESSES, float(statistics.median(slowdowns))),)
        if prompt and pool_ratios:
            prompt_over_model = float(statistics.median(pool_ratios))
    return PoolLevels(levels[False], levels[True], spreads, prompt_over_model)


def measure_pool_level(
    router: ServerProcess,
    decode_url: str,
    headers: dict[str, str],
    handed: dict[str, str],
    log: Path,
    cost: StepCost,
) -> tuple[PoolLevels, Spread]:
    """Measure the decode worker (`decode_url`, its step log at `log`) in ROUNDS rounds
    of both phases (lone first in even rounds, pool first in odd ones); `handed` are
    the headers that have the prefill worker compute a prompt and hand it over.
    With each round's hand-off wait as the pool ran (`handoff_wait`)."""
    rounds, waits = [], []
    for round_ in range(ROUNDS):
        phases = {}
        for busy in (False, True) if round_ % 2 == 0 else (True, False):
            phases[busy] = _phase(router, decode_url, headers, handed, log, busy, round_)
        rounds.append((phases[False][0], phases[True][0]))
        waits.append(phases[True][1])
    return pool_level(rounds, cost), handoff_wait(waits)


@dataclass
class HandedWaits:
    """First-token times of one-token prompts of HANDED_PROMPT_TOKENS sent in turn
    through the prefill worker and to the decode worker alone, as a pool runs."""

    handed: list[float] = field(default_factory=list)
    colocated: list[float] = field(default_factory=list)


def handoff_wait(rounds: Sequence[HandedWaits]) -> Spread:
    """What a hand-off adds to a prompt's first token as a pool runs, per round: the
    median of the pairwise differences of the handed-over and colocated times (one
    stalled request moves it little). Rounds with no prompt of either kind give none."""
    return Spread(rounds=tuple(
        median_difference(waits.handed, waits.colocated)
        for waits in rounds
        if waits.handed and waits.colocated
    ))  # fmt: skip


def _phase(
    router: ServerProcess,
    decode_url: str,
    headers: dict[str, str],
    handed: dict[str, str],
    log: Path,
    busy: bool,
    round_: int,
) -> tuple[list[LoggedStep], HandedWaits]:
    stop = threading.Event()

    def stream_on(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            prompt = rng.integers(FIRST_PROMPT_TOKEN_ID, 256, STREAM_PROMPT_TOKENS).tolist()
            stream_times(decode_url, prompt, headers, STREAM_OUTPUT_TOKENS)

    def hand_on(seed: int) -> None:
        # Each prompt handed over is followed by one the decode worker computes itself:
        # their first tokens' times apart are what a hand-off adds as a pool runs. The
        # lone phase sends the latter only (its prompt steps, the reference).
        rng = np.random.default_rng(seed)
        kinds = ((handed, waits.handed), (headers, waits.colocated))
        while not stop.is_set():
            for kind, times in kinds if busy else kinds[1:]:
                prompt = rng.integers(FIRST_PROMPT_TOKEN_ID, 256, HANDED_PROMPT_TOKENS).tolist()
                started = time.perf_counter()
                stream_times(decode_url, prompt, kind, 1)
                if not stop.is_set():
                    times.append(time.perf_counter() - started)

    seed = 1000 * (round_ + 1) + (500 if busy else 0)
    waits = HandedWaits()
    with ThreadPoolExecutor(STREAMS + 1) as pool:
        running = [pool.submit(stream_on, seed + i) for i in range(STREAMS)]
        try:
            time.sleep(WARM_UP_S)
            begin = log.stat().st_size
            running.append(pool.submit(hand_on, seed + STREAMS))
            if busy:
                route_run(router, ANSWER_TOKENS, seed)
            else:
                time.sleep(ALONE_S)
            time.sleep(SLACK_S)
            steps = read_steps_from(log, begin)
        finally:
            stop.set()
        for future in running:
            future.result()
    return steps, waits
