"""How much a worker's steps slow down while other workers step on the same cores.

Workers are started as processes of their own (the engine under the workers' flags
and threads, as the sweep's); each repeats one mixed step (a decode batch and a
prefill chunk) and one decode-only step. First one worker alone, then two together,
and so on to one more worker than the cores hold: each level's median step time over
the lone worker's is the slowdown, and the contention model's slope is the one whose
predictions come closest to the slowdowns measured (`costs.Contention`). Each level's
steps, each over the median of its kind there, are that level's spread: the steps
that waited out another's time slice."""

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
from pdserve.workers.plan.costs import Contention, StepSpread
from pdserve.workers.plan.scenario import role_setup
from pdserve.workers.plan.sweep import Sweep, SweepPoint, worker_threads

# The step each worker repeats: four decodes at 128 tokens of context and a chunk of
# 128 prompt tokens.
POINT = SweepPoint(context=128, decodes=4, prefill=128, start=0)
WARM_UP_S = 1.0
MOST_WORKERS = 4
START_TIMEOUT_S = 300.0
SLOPES = np.linspace(0.0, 4.0, 401)  # the slopes tried


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
) -> Contention:
    """Step workers alone and together, `level_s` seconds at each level; the fitted
    contention."""
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
        medians: list[float] = []
        spreads: list[tuple[int, StepSpread]] = []
        for count in counts:
            for pipe in pipes[:count]:
                pipe.send(level_s)
            steps: list[list[tuple[float, float]]] = [p.recv() for p in pipes[:count]]
            # A worker whose first pair outlasted the level (a slow machine) has none.
            medians.append(statistics.median(pair_median(pairs) for pairs in steps if pairs))
            spreads.append((count, level_spread(steps)))
            progress(f"profile: {count} workers stepping together: {medians[-1] * 1e3:.1f} ms")
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):  # it is gone already
                pipe.send(None)
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    slowdowns = (median / medians[0] for median in medians)
    samples = tuple(zip(counts, slowdowns, strict=True))
    return Contention(
        slope=fit_slope(samples, cores, threads), samples=samples, spreads=tuple(spreads)
    )


def pair_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The median time of a worker's pairs of steps (a mixed one and a decode-only one)."""
    return statistics.median(chunk + decode for chunk, decode in pairs)


def level_spread(steps: Sequence[Sequence[tuple[float, float]]]) -> StepSpread:
    """The spread of one level's steps: each worker's mixed and decode-only steps, each
    over the median of its kind on that worker."""
    ratios: list[float] = []
    for pairs in steps:
        for kind in range(2):
            times = [pair[kind] for pair in pairs]
            if times:
                typical = statistics.median(times)
                ratios += [seconds / typical for seconds in times]
    return StepSpread.of(ratios)


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
