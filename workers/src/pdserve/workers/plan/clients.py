"""The CPU the router and the load generator spend per request and per token, measured
on a real router in front of a real worker: two runs of the bench's load generator,
one of single-token answers and one of longer ones, each timed in CPU seconds of the
router's process and of the generator's thread. On a machine shared with the workers
this CPU is taken from their cores (`hosts`).

The run of single-token answers also times what a request pays on its way in and its
first token's way out, through the router as the bench sees it: each request's time
to its first token less the predicted compute of its prompt's one step. A last run of
single-token answers goes while a few streams decode on the worker (sent to it
directly): there the request also waits for the step under way (half a decode step,
typically) and its prompt shares its step with their decodes, and what is left beyond
those is a request's overhead on a busy worker: its way in and out now competes with
the worker's own streaming and its steps."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.base.process import ServerProcess, start_server
from pdserve.protocol.internal import bearer, read_credential
from pdserve.workers.bench.config import FIRST_PROMPT_TOKEN_ID, BenchConfig
from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.bench.runner import run_benchmark
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import ClientCost, ServingOverhead, Spread, StepCost

REQUESTS = 24
RATE = 8.0  # requests per second
ANSWER_TOKENS = (1, 32)  # the most tokens a request of each run asks for
PROMPT_TOKENS = 64  # the most prompt tokens (short: the worker is not what is timed)
VOCAB = 256  # token ids the prompts draw from (any model has them)
REQUEST_TIMEOUT_S = 120.0
# The streams decoding on the worker while the busy overhead is timed, each of prompts
# and answers of these lengths, one after another until the run is over.
BUSY_STREAMS = 4
BUSY_PROMPT_TOKENS = 32
BUSY_OUTPUT_TOKENS = 48
BUSY_WARM_UP_S = 0.5
FEEDS_TIMEOUT_S = 30.0  # the longest the router may take to follow the workers' feeds
# The three runs (single-token answers, longer ones, single-token on a busy worker)
# are made this many times over, each time with prompts of their own: the figures are
# taken over all of them, and each round's own gives their spread.
ROUNDS = 3


@dataclass(frozen=True)
class Overheads:
    """A request's overhead through the router on an idle and on a busy worker (None:
    no request answered)."""

    idle_s: float | None
    busy_s: float | None


@contextlib.contextmanager
def pool_router(
    model: Path, decode_url: str, prefill_url: str, credential: Path, scratch: Path
) -> Iterator[ServerProcess]:
    """A router in front of the pair as a pool's is: it follows both workers' KV event
    feeds (a worker publishes its prefix cache's events on every step that stores a
    block, and serving them is work on the worker's own CPU), and routes colocated to
    the decode worker. Ready, with both feeds followed, for the `with` block."""
    table = {
        "pool": "profile",
        "model": {"name": str(model), "path": str(model)},
        "buckets": [{"mode": "colocated"}],
        "discovery": {"kind": "static", "decode": [decode_url], "prefill": [prefill_url]},
    }
    config = scratch / "routing.json"
    config.write_text(json.dumps(table))
    router = start_server(
        "router", scratch / "router.log", ["--config", str(config),
                                           "--internal-token-file", str(credential)],
    )  # fmt: skip
    try:
        router.wait_ready()
        _wait_following(router, feeds=2)
        yield router
    finally:
        router.stop()


def measure_client_cost(
    router: ServerProcess,
    decode_url: str,
    credential: Path,
    costs: tuple[StepCost, ServingOverhead],
) -> tuple[ClientCost, Overheads, dict[str, Spread]]:
    """Route runs through `router` to the decode worker at `decode_url`, in ROUNDS
    rounds: the client cost, a request's overhead through the router on the worker
    idle and busy (beyond the steps' compute as the step cost and the serving worker's
    give it), over every round's requests; and those figures as each round gave them."""
    headers = {"Content-Type": "application/json", **bearer(read_credential(credential))}
    samples: list[tuple[int, int, float]] = []
    idle: list[RequestRecord] = []
    busy: list[RequestRecord] = []
    rounds: list[tuple[ClientCost, float | None, float | None]] = []
    for round_ in range(ROUNDS):
        runs = [route_run(router, tokens, seed=tokens + 100 * round_) for tokens in ANSWER_TOKENS]
        loaded = _busy_run(router, decode_url, headers, seed=1 + 100 * round_)
        samples += [sample for sample, _ in runs]
        idle += runs[0][1]
        busy += loaded
        rounds.append((
            _fit(tuple(sample for sample, _ in runs)), request_overhead_s(runs[0][1], costs),
            request_overhead_s(loaded, costs, BUSY_STREAMS),
        ))  # fmt: skip
    overheads = Overheads(
        request_overhead_s(idle, costs), request_overhead_s(busy, costs, BUSY_STREAMS)
    )
    spreads = {
        "clients.per_request_s": Spread(rounds=tuple(c.per_request_s for c, _, _ in rounds)),
        "clients.per_token_s": Spread(rounds=tuple(c.per_token_s for c, _, _ in rounds)),
        "request_overhead_s": Spread(rounds=tuple(s for _, s, _ in rounds if s is not None)),
        "busy_request_overhead_s": Spread(rounds=tuple(s for _, _, s in rounds if s is not None)),
    }
    return _fit(tuple(samples)), overheads, spreads


def _wait_following(router: ServerProcess, feeds: int) -> None:
    """Until the router's KV index follows `feeds` workers (a router that never gets
    there is measured anyway: its feeds are what it would follow in a pool)."""
    deadline = time.monotonic() + FEEDS_TIMEOUT_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{router.url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        synced = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pdserve_router_kv_workers{") and 'state="synced"' in line
        )
        if synced >= feeds:
            return
        time.sleep(0.1)


def request_overhead_s(
    records: Sequence[RequestRecord], costs: tuple[StepCost, ServingOverhead], decodes: int = 0
) -> float | None:
    """The median of each answered request's time to its first token less the
    predicted compute of its prompt in one step beside `decodes` decodes, and of half
    a decode-only step before it where there are decodes (never below zero)."""
    cost, serving = costs
    context = BUSY_PROMPT_TOKENS + BUSY_OUTPUT_TOKENS // 2  # the decodes' keys, mid-run
    waited = 0.0
    if decodes:
        waited = cost.seconds(StepFeatures(decodes, 0, decodes * context, 0)) / 2
    beyond = [
        record.chunk_times[0] - record.sent_at - waited
        - serving.compute(StepFeatures(decodes, record.input_tokens, decodes * context,
                                       record.input_tokens**2), cost)
        for record in records
        if record.ok and record.sent_at is not None
    ]  # fmt: skip
    return max(0.0, statistics.median(beyond)) if beyond else None


def _busy_run(
    router: ServerProcess, decode_url: str, headers: dict[str, str], seed: int = 1
) -> list[RequestRecord]:
    """The records of single-token answers through the router while BUSY_STREAMS
    streams decode on the worker."""
    stop = threading.Event()

    def stream_on(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            prompt = rng.integers(FIRST_PROMPT_TOKEN_ID, VOCAB, BUSY_PROMPT_TOKENS).tolist()
            stream_times(decode_url, prompt, headers, BUSY_OUTPUT_TOKENS)

    with ThreadPoolExecutor(BUSY_STREAMS) as pool:
        streams = [pool.submit(stream_on, seed) for seed in range(BUSY_STREAMS)]
        try:
            time.sleep(BUSY_WARM_UP_S)  # the streams are decoding
            _, records = route_run(router, 1, seed)
        finally:
            stop.set()
        for stream in streams:
            stream.result()
    return records


def stream_times(
    url: str, prompt: list[int], headers: dict[str, str], max_tokens: int
) -> list[float]:
    """When each event of a streamed completion from `url` arrived."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), headers, method="POST"
    )
    times: list[float] = []
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
        for line in answer:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


def route_run(
    router: ServerProcess, answer_tokens: int, seed: int
) -> tuple[tuple[int, int, float], list[RequestRecord]]:
    """(requests, tokens streamed, CPU seconds of the router and the generator), and
    the requests' records (prompts drawn with `seed`: no run finds another's cached)."""
    config = BenchConfig(
        url=router.url, workload="chat", rate=RATE, num_requests=REQUESTS, seed=seed,
        vocab_size=VOCAB, max_input_tokens=PROMPT_TOKENS, max_output_tokens=answer_tokens,
    )  # fmt: skip
    before = _process_cpu_s(router.process.pid)
    result = run_benchmark(config)
    router_s = _process_cpu_s(router.process.pid) - before
    tokens = sum(sum(record.chunk_tokens) for record in result.records)
    return (len(result.records), tokens, router_s + result.generator_cpu_s), result.records


def _fit(samples: tuple[tuple[int, int, float], ...]) -> ClientCost:
    """Per request and per token, both non-negative, by least squares."""
    design = np.array([[requests, tokens] for requests, tokens, _ in samples], dtype=float)
    cpu = np.array([seconds for *_, seconds in samples])
    (per_request, per_token), *_ = np.linalg.lstsq(design, cpu, rcond=None)
    if per_token < 0:
        per_request, per_token = float(cpu.sum() / design[:, 0].sum()), 0.0
    if per_request < 0:
        per_request, per_token = 0.0, float(cpu.sum() / max(1.0, design[:, 1].sum()))
    return ClientCost(
        per_request_s=float(per_request), per_token_s=float(per_token), samples=samples
    )


def _process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process so far (Linux's /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime and stime: the 14th and 15th fields, the 12th and 13th after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
