"""Measuring a real prefill/decode pair: a worker's start-up, a request's overhead on
its way through a worker, and what a hand-off adds to the first token by the bytes
of KV it sends.

Two workers are started as a pool starts them (`pdserve worker`, the pool's
credential, the decode worker naming its prefill peer). Each prompt length is asked
for one token colocated (the decode worker prefills it) and disaggregated (the
prefill worker does, then hands the KV over); the difference of the medians is the
hand-off's time for that many bytes, fitted as fixed plus per byte. Then a few
batches of streams decode together on the decode worker: its steps' cadence (the
time between their tokens, as its step log tells it) beyond the compute the
step-cost model gives such a step is what serving adds to a step, fitted as fixed
plus per token streamed, and each gap the streams see over their batch's median is
the spread of a serving worker's steps. Then prompts sent one at a time while streams
decode: what the steps carrying them took, as the decode worker's step log tells it,
over the step-cost model's compute, is the mixed factor (`step_log`). Last, through
the router: the CPU it and the load generator spend per request and token, and a
request's overhead as the bench sees it (`clients`).

A router runs in front of the pair throughout, as in a pool: it follows both
workers' KV event feeds, so every step that stores a block (each prompt chunk) is
timed with the worker serving its events, as it does in a pool.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from pdserve.base.credentials import write_new_credential
from pdserve.protocol.headers import PREFILL_URL_HEADER
from pdserve.protocol.internal import bearer
from pdserve.workers.bench.config import FIRST_PROMPT_TOKEN_ID
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.clients import (
    REQUEST_TIMEOUT_S,
    measure_client_cost,
    pool_router,
    stream_times,
)
from pdserve.workers.plan.costs import (
    ClientCost,
    HandoffCost,
    ServingOverhead,
    Spread,
    StepCost,
    StepSpread,
)
from pdserve.workers.plan.fit import median_difference
from pdserve.workers.plan.pool_level import HANDED_PROMPT_TOKENS, measure_pool_level
from pdserve.workers.plan.step_log import (
    cadence_beyond,
    decode_steps_beyond,
    prompt_step_samples,
    read_steps,
    read_steps_from,
    step_logging_env,
)
from pdserve.workers.server.process import ServerProcess, start_worker

REPEATS = 3  # of each kind of prompt, each length, each round
# The hand-off is measured this many times over, the lengths in alternate orders.
HANDOFF_ROUNDS = 3
# Streams decoding together, each with a prompt and an answer of these lengths; the
# first gaps of each stream (its batch still prefilling) are left out.
STREAMS = (1, 4, 8, 16)
STREAM_PROMPT_TOKENS = 32
STREAM_OUTPUT_TOKENS = 48
STREAM_SKIP_GAPS = 6
# The batches of streams are measured this many times over, in alternate orders.
SERVING_ROUNDS = 3
# The prompts sent, each alone in its step (under the default token budget), while
# MIXED_STREAMS streams decode answers of MIXED_OUTPUT_TOKENS one after another.
MIXED_PROMPTS = (128, 256, 448)
MIXED_STREAMS = 4
MIXED_OUTPUT_TOKENS = 192
MIXED_WARM_UP_S = 0.5
MIXED_ROUNDS = 10  # each of MIXED_PROMPTS sent once a round
# How long after the last prompt's answer its step's lines are surely in the log.
MIXED_SLACK_S = 0.2


@dataclass(frozen=True)
class PairFigures:
    """What the pair measured."""

    handoff: HandoffCost
    request_overhead_s: float
    startup_s: float
    serving: ServingOverhead
    clients: ClientCost
    busy_request_overhead_s: float | None = None
    # The contention levels measured as a pool runs (`pool_level`): of decode-only
    # steps, and of steps that carry a prompt's chunk.
    pool: tuple[tuple[int, float], ...] = ()
    pool_prompt: tuple[tuple[int, float], ...] = ()
    pool_prompt_over_model: float | None = None
    # Figures measured in rounds, by name, as each round gave them.
    spreads: dict[str, Spread] = field(default_factory=dict)


@dataclass(frozen=True)
class PairSetup:
    """The model, the workers' flags, and the lengths to ask for."""

    model: Path
    worker_args: tuple[str, ...]
    backend: str
    lengths: tuple[int, ...]
    block_bytes: int
    block_size: int
    vocab: int


def measure_pair(
    setup: PairSetup, cost: StepCost, progress: Callable[[str], None] = lambda line: None
) -> PairFigures:
    """Start the pair, measure, stop it."""
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as scratch:
        directory = Path(scratch)
        credential = write_new_credential(directory / "credential")
        common = ["--port", "0", "--internal-token-file", str(directory / "credential")]
        common += ["--kv-transfer", setup.backend, *setup.worker_args]
        # Both log their steps, as a measured pool's workers do (two lines a step).
        env = step_logging_env(directory)
        started = time.perf_counter()
        prefill_args = ["--role", "prefill", *common]
        prefill = start_worker(setup.model, directory / "prefill.log", prefill_args, env)
        workers = [prefill]
        try:
            prefill.wait_ready()
            startup_s = time.perf_counter() - started
            decode_args = ["--role", "decode", "--prefill-peer", prefill.url, *common]
            decode = start_worker(setup.model, directory / "decode.log", decode_args, env)
            workers.append(decode)
            decode.wait_ready()
            progress(f"profile: worker pair ready ({startup_s:.1f}s to start one worker)")
            credential_file = directory / "credential"
            with pool_router(
                setup.model, decode.url, prefill.url, credential_file, directory
            ) as router:
                figures = _measure(setup, cost, credential, prefill, decode, startup_s)
                clients, overheads, spreads = measure_client_cost(
                    router, decode.url, credential_file, (cost, figures.serving)
                )
                headers = {"Content-Type": "application/json", **bearer(credential)}
                handed = {**headers, PREFILL_URL_HEADER: prefill.url}
                pool, waits = measure_pool_level(
                    router, decode.url, headers, handed, decode.log_path, cost
                )
                spreads.update(pool.spreads)
                spreads["handoff.pool_s"] = waits
                progress(
                    f"profile: a pool's steps over a lone worker's: decode-only "
                    f"{pool.decode[-1][1]:.2f}, with a prompt {pool.prompt[-1][1]:.2f}"
                )
            handoff = figures.handoff
            if waits.rounds:  # what a request waits for its hand-off as a pool runs
                blocks = -(-HANDED_PROMPT_TOKENS // setup.block_size)
                sent_s = handoff.per_byte_s * blocks * setup.block_bytes
                pool_s = max(0.0, float(statistics.median(waits.rounds)) - sent_s)
                handoff = handoff.model_copy(update={"pool_s": pool_s})
            figures = replace(
                figures, clients=clients, busy_request_overhead_s=overheads.busy_s,
                pool=pool.decode, pool_prompt=pool.prompt,
                pool_prompt_over_model=pool.prompt_over_model,
                spreads={**figures.spreads, **spreads}, handoff=handoff,
            )  # fmt: skip
            if overheads.idle_s is None:  # no request answered through the router
                return figures
            return replace(figures, request_overhead_s=overheads.idle_s)
        finally:
            for worker in workers:
                worker.stop()


def _measure(
    setup: PairSetup,
    cost: StepCost,
    credential: str,
    prefill: ServerProcess,
    decode: ServerProcess,
    startup_s: float,
) -> PairFigures:
    rng = np.random.default_rng(0)
    headers = {"Content-Type": "application/json", **bearer(credential)}
    handed = {**headers, PREFILL_URL_HEADER: prefill.url}
    # One warm-up of each kind, then the lengths in HANDOFF_ROUNDS rounds (in one
    # order, then the reverse), each length's colocated and handed-over prompts
    # alternating, so that a slow stretch falls on neither kind and no length alone.
    for kind in (headers, handed):
        _first_token_s(decode.url, _prompt(rng, setup.vocab, setup.lengths[0]), kind)
    extra: list[list[tuple[int, float]]] = []  # per round, (bytes, seconds handed over)
    local_by_length: dict[int, list[float]] = {length: [] for length in setup.lengths}
    for round_ in range(HANDOFF_ROUNDS):
        points = []
        for length in setup.lengths if round_ % 2 == 0 else setup.lengths[::-1]:
            colocated, disaggregated = [], []
            for _ in range(REPEATS):
                prompt = _prompt(rng, setup.vocab, length)
                colocated.append(_first_token_s(decode.url, prompt, headers))
                prompt = _prompt(rng, setup.vocab, length)
                disaggregated.append(_first_token_s(decode.url, prompt, handed))
            local_by_length[length] += colocated
            blocks = -(-length // setup.block_size)
            handed_s = median_difference(disaggregated, colocated)
            points.append((blocks * setup.block_bytes, handed_s))
        extra.append(points)
    overheads = [(length, statistics.median(times)) for length, times in local_by_length.items()]
    streamed = _Streamed(decode.url, headers, setup.vocab, rng, decode.log_path)
    serving, spreads = _serving_overhead(streamed, cost)
    serving, factor, beyond = _with_mixed_factor(serving, streamed, cost)
    spreads["serving.mixed_factor"] = factor
    spreads["serving.decode_step_beyond_model_s"] = beyond
    handoff, handoff_spreads = fit_handoff_rounds(extra, setup.backend)
    spreads.update(handoff_spreads)
    # The shortest prompt's: the least of its time is the predicted compute subtracted
    # (a long prompt's is chunked, and an error in its compute would hide the overhead).
    length, local = overheads[0]
    computed = serving.compute(StepFeatures(prefill_tokens=length, prefill_keys=length**2), cost)
    overhead = max(0.0, local - computed)
    return PairFigures(handoff, overhead, startup_s, serving, ClientCost(), spreads=spreads)


@dataclass(frozen=True)
class _Streamed:
    """The worker that streams and answers the prompts of a measurement, and how they
    are drawn."""

    url: str
    headers: dict[str, str]
    vocab: int
    rng: np.random.Generator
    log: Path  # the worker's, with its step log lines

    def prompt(self, length: int) -> list[int]:
        """A prompt of `length` random tokens."""
        drawn: list[int] = self.rng.integers(FIRST_PROMPT_TOKEN_ID, self.vocab, length).tolist()
        return drawn


def _serving_overhead(
    worker: _Streamed, cost: StepCost
) -> tuple[ServingOverhead, dict[str, Spread]]:
    """What a serving worker's steps take beyond their predicted compute, per batch of
    streams decoding together: each batch measured in SERVING_ROUNDS rounds (the sizes
    in one order, then the reverse, so a slow stretch falls on no size alone), as the
    worker's step log gives it (`step_log.cadence_beyond`; the streams' median gap
    where no step logged its cadence), its median over the rounds; fitted as fixed
    plus per token streamed. With the fixed and per-token times each round's batches
    alone give, and each batch's rounds. The streams' gaps, each over its batch's
    median gap, are the spread a serving worker's clients see (with the median gap: the
    length of the steps it was measured on)."""
    ratios: list[float] = []  # each gap over its batch's median gap
    every_gap: list[float] = []
    context = STREAM_PROMPT_TOKENS + STREAM_OUTPUT_TOKENS // 2  # a decode's keys, mid-run
    tokens = STREAM_OUTPUT_TOKENS
    rounds: list[dict[int, float]] = []
    for round_ in range(SERVING_ROUNDS):
        points: dict[int, float] = {}
        for streams in STREAMS if round_ % 2 == 0 else STREAMS[::-1]:
            prompts = [worker.prompt(STREAM_PROMPT_TOKENS) for _ in range(streams)]
            begin = worker.log.stat().st_size
            with ThreadPoolExecutor(streams) as pool:
                times = list(pool.map(
                    lambda p: stream_times(worker.url, p, worker.headers, tokens), prompts
                ))  # fmt: skip
            gaps = [float(gap) for t in times for gap in np.diff(t[STREAM_SKIP_GAPS:])]
            typical = statistics.median(gaps)
            ratios += [gap / typical for gap in gaps]
            every_gap += gaps
            beyond = cadence_beyond(read_steps_from(worker.log, begin), streams, cost)
            if beyond is None:
                step = StepFeatures(decode_tokens=streams, decode_keys=streams * context)
                beyond = typical - cost.seconds(step)
            points[streams] = beyond
        rounds.append(points)
    serving, spreads = fit_serving(rounds)
    typical_s = statistics.median(every_gap) if every_gap else None
    return serving.model_copy(update={"spread": StepSpread.of(ratios, typical_s)}), spreads


def fit_serving(
    rounds: Sequence[dict[int, float]],
) -> tuple[ServingOverhead, dict[str, Spread]]:
    """Serving's fixed and per-token times from each round's (streams: seconds beyond
    the model per step) batches: each batch's median over the rounds (one round's
    stall moves no batch), fitted as fixed plus per token streamed; with the fit each
    round alone gives, and each batch's rounds."""
    by_streams: dict[int, list[float]] = {}
    for points in rounds:
        for streams, beyond in points.items():
            by_streams.setdefault(streams, []).append(beyond)
    medians = [(n, float(statistics.median(b))) for n, b in sorted(by_streams.items())]
    fixed, per_token = _non_negative_line(medians)
    fits = [_non_negative_line(sorted(points.items())) for points in rounds if points]
    spreads = {
        "serving.fixed_s": Spread(rounds=tuple(fixed for fixed, _ in fits)),
        "serving.per_token_s": Spread(rounds=tuple(per_token for _, per_token in fits)),
        **{f"serving.beyond_s.{n}": Spread(rounds=tuple(b)) for n, b in by_streams.items()},
    }
    return ServingOverhead(fixed_s=fixed, per_token_s=per_token, samples=tuple(medians)), spreads


def _with_mixed_factor(
    serving: ServingOverhead, worker: _Streamed, cost: StepCost
) -> tuple[ServingOverhead, Spread, Spread]:
    """`serving` with the mixed factor: prompts of MIXED_PROMPTS tokens sent one at a
    time (one token each) while streams decode; each step of that time that ran one
    of their chunks, what it took (less what every step takes beyond the model) over
    the step-cost model's compute of it, is a sample (`step_log`). The factor is the
    samples' median; each of the MIXED_ROUNDS rounds of prompts gives one too, its
    spread."""
    stop = threading.Event()

    def stream_on(seed: int) -> None:
        stream_rng = np.random.default_rng(seed)
        while not stop.is_set():
            prompt = stream_rng.integers(FIRST_PROMPT_TOKEN_ID, worker.vocab, STREAM_PROMPT_TOKENS)
            stream_times(worker.url, prompt.tolist(), worker.headers, MIXED_OUTPUT_TOKENS)

    with ThreadPoolExecutor(MIXED_STREAMS) as pool:
        streams = [pool.submit(stream_on, seed) for seed in range(MIXED_STREAMS)]
        try:
            time.sleep(MIXED_WARM_UP_S)
            offsets = []  # where each round's lines begin in the log
            for _ in range(MIXED_ROUNDS):
                offsets.append(worker.log.stat().st_size)
                for length in MIXED_PROMPTS:
                    _first_token_s(worker.url, worker.prompt(length), worker.headers)
            time.sleep(MIXED_SLACK_S)  # the last step's lines reach the log
            logged = worker.log.read_bytes()
        finally:
            stop.set()
        for stream in streams:
            stream.result()
    # The streams' own prompts are shorter than any of MIXED_PROMPTS.
    logs = [
        read_steps(logged[begin:end].decode(errors="replace"))
        for begin, end in itertools.pairwise([*offsets, len(logged)])
    ]
    # What every step takes beyond the model, over all the rounds' decode-only steps
    # (a round's few move it by milliseconds), taken off each prompt step; per round
    # beside the factor's own spread, it says whether the worker's steps moved it.
    every_step_s = decode_steps_beyond([step for steps in logs for step in steps], cost)
    rounds = [prompt_step_samples(steps, cost, min(MIXED_PROMPTS), every_step_s) for steps in logs]
    beyond = Spread(rounds=tuple(decode_steps_beyond(steps, cost) for steps in logs))
    samples = tuple(sample for round_ in rounds for sample in round_)
    spread = Spread(rounds=tuple(
        statistics.median(ratio for _, ratio in round_) for round_ in rounds if round_
    ))  # fmt: skip
    if not samples:
        return serving, spread, beyond
    factor = max(1e-3, statistics.median(ratio for _, ratio in samples))
    updated = serving.model_copy(update={"mixed_factor": factor, "mixed_samples": samples})
    return updated, spread, beyond


def fit_handoff_rounds(
    rounds: Sequence[Sequence[tuple[int, float]]], backend: str
) -> tuple[HandoffCost, dict[str, Spread]]:
    """The hand-off's cost from each round's (bytes, seconds handed over beyond
    colocated) points: each length's median over the rounds (one round's stall moves
    no length), fitted as fixed plus per byte; with the fit each round alone gives."""
    by_bytes: dict[int, list[float]] = {}
    for points in rounds:
        for nbytes, seconds in points:
            by_bytes.setdefault(nbytes, []).append(seconds)
    medians = [(nbytes, float(statistics.median(s))) for nbytes, s in sorted(by_bytes.items())]
    handoff = _fit_handoff(medians, backend)
    fits = [_non_negative_line(points) for points in rounds if points]
    spreads = {
        "handoff.fixed_s": Spread(rounds=tuple(fixed for fixed, _ in fits)),
        "handoff.per_byte_s": Spread(rounds=tuple(per_byte for _, per_byte in fits)),
    }
    return handoff, spreads


def _prompt(rng: np.random.Generator, vocab: int, length: int) -> list[int]:
    drawn: list[int] = rng.integers(FIRST_PROMPT_TOKEN_ID, vocab, length).tolist()
    return drawn


def _fit_handoff(points: Sequence[tuple[int, float]], backend: str) -> HandoffCost:
    """Fixed plus per byte, both non-negative, by least squares."""
    fixed, per_byte = _non_negative_line(points)
    samples = tuple((int(n), float(s)) for n, s in points)
    return HandoffCost(fixed_s=fixed, per_byte_s=per_byte, backend=backend, samples=samples)


def _non_negative_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope of `seconds = a + b x`, both non-negative, by least squares
    (negative times count as none)."""
    xs = np.array([float(x) for x, _ in points])
    seconds = np.array([max(0.0, s) for _, s in points])
    design = np.stack([np.ones_like(xs), xs], axis=1)
    (fixed, slope), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if slope < 0:
        fixed, slope = float(seconds.mean()), 0.0
    if fixed < 0:
        fixed, slope = 0.0, float((xs @ seconds) / (xs @ xs)) if xs.any() else 0.0
    return float(fixed), float(slope)


def _first_token_s(url: str, prompt: list[int], headers: dict[str, str]) -> float:
    """Seconds until the answer to a one-token completion is in."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), headers, method="POST"
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
        answer.read()
    return time.perf_counter() - started
