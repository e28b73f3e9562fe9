"""How much a worker's steps slow down while other workers step on the same cores.

Workers are started as processes of their own (the engine under the workers' flags
and threads, as the sweep's); each repeats one mixed step (a decode batch and a
prefill chunk) and one decode-only step. One worker alone, then two together, and so
on to one more worker than the cores hold, in rounds: the levels in one order, then
in the reverse order, and so on, so that a slow stretch of the machine does not fall
on one level (in one pass, the highest level came last, and a neighbour's work then
read as contention). In each round each level's median step time over the lone
worker's in the same round is that round's slowdown; a level's slowdown is the median
over the rounds, and the contention model's slope is the one whose predictions come
closest to those (`costs.Contention`); the slope fitted to each round alone gives its
spread. Each level's steps, each over the median of its kind there, are that level's
spread of steps: the steps that waited out another's time slice."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.plan.costs import Contention, Spread, StepSpread
from pdserve.workers.plan.scenario import role_setup
from pdserve.workers.plan.sweep import Sweep, SweepPoint, worker_threads

# The step each worker repeats: four decodes at 128 tokens of context and a chunk of
# 128 prompt tokens.
POINT = SweepPoint(context=128, decodes=4, prefill=128, start=0)
WARM_UP_S = 1.0
MOST_WORKERS = 4
START_TIMEOUT_S = 300.0
SLOPES = np.linspace(0.0, 4.0, 401)  # the slopes tried
ROUNDS = 3  # passes over the levels, each level `level_s / ROUNDS` seconds a pass


def levels(cores: int, threads: int) -> tuple[int, ...]:
    """Workers stepping together at each level: one, two, ... to one more than the
    cores hold (at least two, at most MOST_WORKERS)."""
    top = min(MOST_WORKERS, max(2, cores // threads + 1))
    return tuple(range(1, top + 1))


def measure_contention(
    model: Path,
    worker_args: Sequence[str],
    cores: int,
    threads: int,
    level_s: float,
    progress: Callable[[str], None] = lambda line: None,
) -> tuple[Contention, dict[str, Spread]]:
    """Step workers alone and together, `level_s` seconds at each level over all
    rounds; the fitted contention, and its figures as each round gave them."""
    counts = levels(cores, threads)
    spawn = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    processes = []
    try:
        for _ in range(counts[-1]):
            mine, theirs = spawn.Pipe()
            process = spawn.Process(
                target=_step_loop, args=(str(model), tuple(worker_args), theirs), daemon=True
            )
            process.start()
            pipes.append(mine)
            processes.append(process)
        for pipe in pipes:
            if not pipe.poll(START_TIMEOUT_S):
                raise RuntimeError("a contention worker did not start")
            pipe.recv()
        rounds: list[dict[int, float]] = []  # each round's median pair time by level
        steps: dict[int, list[list[tuple[float, float]]]] = {count: [] for count in counts}
        for round_ in range(ROUNDS):
            medians: dict[int, float] = {}
            for count in counts if round_ % 2 == 0 else counts[::-1]:
                for pipe in pipes[:count]:
                    pipe.send(level_s / ROUNDS)
                level = [p.recv() for p in pipes[:count]]
                steps[count] += level
                # A worker whose first pair outlasted the level (a slow machine) has none.
                medians[count] = statistics.median(pair_median(pairs) for pairs in level if pairs)
                progress(f"profile: {count} workers stepping together (round {round_ + 1}): "
                         f"{medians[count] * 1e3:.1f} ms")  # fmt: skip
            rounds.append(medians)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):  # it is gone already
                pipe.send(None)
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    per_round = [round_slowdowns(medians) for medians in rounds]
    samples = median_slowdowns(per_round)
    contention = Contention(
        slope=fit_slope(samples, cores, threads),
        samples=samples,
        spreads=tuple((count, level_spread(steps[count])) for count in counts),
    )
    figures = {"contention.slope": Spread(rounds=tuple(
        fit_slope(tuple(slowdowns.items()), cores, threads) for slowdowns in per_round
    ))}  # fmt: skip
    for count in counts[1:]:
        figures[f"contention.slowdown.{count}"] = Spread(
            rounds=tuple(slowdowns[count] for slowdowns in per_round)
        )
    return contention, figures


def round_slowdowns(medians: dict[int, float]) -> dict[int, float]:
    """One round's slowdown of each level: its median over the lone worker's in the
    same round (the machine's pace then)."""
    alone = medians[min(medians)]
    return {count: medians[count] / alone for count in sorted(medians)}


def median_slowdowns(per_round: Sequence[dict[int, float]]) -> tuple[tuple[int, float], ...]:
    """Each level's median slowdown over the rounds: a round in which another process
    took the cores does not move it."""
    counts = sorted(per_round[0])
    return tuple(
        (count, float(statistics.median(slowdowns[count] for slowdowns in per_round)))
        for count in counts
    )


def pair_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The median time of a worker's pairs of steps (a mixed one and a decode-only one)."""
    return statistics.median(chunk + decode for chunk, decode in pairs)


def level_spread(steps: Sequence[Sequence[tuple[float, float]]]) -> StepSpread:
    """The spread of one level's steps: each worker's mixed and decode-only steps, each
    over the median of its kind on that worker; measured on steps of the mean of those
    medians."""
    ratios: list[float] = []
    typicals: list[float] = []
    for pairs in steps:
        for kind in range(2):
            times = [pair[kind] for pair in pairs]
            if times:
                typical = statistics.median(times)
                ratios += [seconds / typical for seconds in times]
                typicals.append(typical)
    return StepSpread.of(ratios, statistics.mean(typicals) if typicals else None)


def fit_slope(samples: Sequence[tuple[int, float]], cores: int, threads: int) -> float:
    """The slope whose stretches are relatively closest to the measured slowdowns."""
    if len(samples) < 2:
        return 0.0

    def misfit(slope: float) -> float:
        model = Contention(slope=slope)
        return sum(
            (model.stretch(count * threads, threads, cores) / slowdown - 1.0) ** 2
            for count, slowdown in samples
        )

    return float(min(SLOPES, key=misfit))


def _step_loop(model: str, worker_args: tuple[str, ...], pipe: Connection) -> None:
    """A contention worker: build the engine, warm up, say so, then step for as long
    as each message says, answering the pairs' seconds, until told None.

    It runs in a session of its own, as a pool's workers do (`base.process`): a
    kernel that shares the CPU between sessions (Linux's autogroups) shares it between
    these workers as between a pool's, not as threads of one session."""
    with contextlib.suppress(OSError):  # a session's leader already
        os.setsid()
    setup = role_setup("profile", ["--model", model, *worker_args])
    with worker_threads(setup):
        sweep = Sweep(LLMEngine(setup.engine))
        sweep.repeat(POINT, WARM_UP_S)
        pipe.send("ready")
        while (seconds := pipe.recv()) is not None:
            pipe.send(sweep.repeat(POINT, seconds))
