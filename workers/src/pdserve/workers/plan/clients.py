"""The CPU the router and the load generator spend per request and per token, measured
on a real router in front of a real worker: two runs of the bench's load generator,
one of single-token answers and one of longer ones, each timed in CPU seconds of the
router's process and of the generator's thread. On a machine shared with the workers
this CPU is taken from their cores (`hosts`).

The run of single-token answers also times what a request pays on its way in and its
first token's way out, through the router as the bench sees it: each request's time
to its first token less the predicted compute of its prompt's one step."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.base.process import ServerProcess, start_server
from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.bench.runner import run_benchmark
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import ClientCost, StepCost

REQUESTS = 24
RATE = 8.0  # requests per second
ANSWER_TOKENS = (1, 32)  # the most tokens a request of each run asks for
PROMPT_TOKENS = 64  # the most prompt tokens (short: the worker is not what is timed)
VOCAB = 256  # token ids the prompts draw from (any model has them)


def measure_client_cost(
    model: Path, decode_url: str, credential: Path, scratch: Path, cost: StepCost
) -> tuple[ClientCost, float | None]:
    """Route two runs through a router to the decode worker at `decode_url`: the
    client cost, and a request's overhead through the router (None: none answered)."""
    table = {
        "pool": "profile",
        "model": {"name": str(model), "path": str(model)},
        "buckets": [{"mode": "colocated"}],
        "discovery": {"kind": "static", "decode": [decode_url], "prefill": []},
    }
    config = scratch / "routing.json"
    config.write_text(json.dumps(table))
    router = start_server(
        "router", scratch / "router.log", ["--config", str(config),
                                           "--internal-token-file", str(credential)],
    )  # fmt: skip
    try:
        router.wait_ready()
        runs = [_run(router, tokens) for tokens in ANSWER_TOKENS]
    finally:
        router.stop()
    samples = tuple(sample for sample, _ in runs)
    return _fit(samples), request_overhead_s(runs[0][1], cost)


def request_overhead_s(records: Sequence[RequestRecord], cost: StepCost) -> float | None:
    """The median of each answered request's time to its first token less the
    predicted compute of its prompt in one step (never below zero)."""
    beyond = [
        record.chunk_times[0] - record.sent_at
        - cost.seconds(StepFeatures(prefill_tokens=record.input_tokens,
                                    prefill_keys=record.input_tokens**2))
        for record in records
        if record.ok and record.sent_at is not None
    ]  # fmt: skip
    return max(0.0, statistics.median(beyond)) if beyond else None


def _run(
    router: ServerProcess, answer_tokens: int
) -> tuple[tuple[int, int, float], list[RequestRecord]]:
    """(requests, tokens streamed, CPU seconds of the router and the generator), and
    the requests' records."""
    config = BenchConfig(
        url=router.url, workload="chat", rate=RATE, num_requests=REQUESTS, seed=answer_tokens,
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
