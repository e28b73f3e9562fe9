"""The CPU the router and the load generator spend per request and per token, measured
on a real router in front of a real worker: two runs of the bench's load generator,
one of single-token answers and one of longer ones, each timed in CPU seconds of the
router's process and of the generator's thread. On a machine shared with the workers
this CPU is taken from their cores (`hosts`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from pdserve.base.process import ServerProcess, start_server
from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.runner import run_benchmark
from pdserve.workers.plan.costs import ClientCost

REQUESTS = 24
RATE = 8.0  # requests per second
ANSWER_TOKENS = (1, 32)  # the most tokens a request of each run asks for
PROMPT_TOKENS = 64  # the most prompt tokens (short: the worker is not what is timed)
VOCAB = 256  # token ids the prompts draw from (any model has them)


def measure_client_cost(
    model: Path, decode_url: str, credential: Path, scratch: Path
) -> ClientCost:
    """Route two runs through a router to the decode worker at `decode_url`."""
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
        samples = tuple(_run(router, tokens) for tokens in ANSWER_TOKENS)
    finally:
        router.stop()
    return _fit(samples)


def _run(router: ServerProcess, answer_tokens: int) -> tuple[int, int, float]:
    """(requests, tokens streamed, CPU seconds of the router and the generator)."""
    config = BenchConfig(
        url=router.url, workload="chat", rate=RATE, num_requests=REQUESTS, seed=answer_tokens,
        vocab_size=VOCAB, max_input_tokens=PROMPT_TOKENS, max_output_tokens=answer_tokens,
    )  # fmt: skip
    before = _process_cpu_s(router.process.pid)
    result = run_benchmark(config)
    router_s = _process_cpu_s(router.process.pid) - before
    tokens = sum(sum(record.chunk_tokens) for record in result.records)
    return len(result.records), tokens, router_s + result.generator_cpu_s


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
