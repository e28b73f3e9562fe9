"""What a router following a worker's KV event feed costs the worker's steps: one
worker on the tiny model (one torch thread), prompts of 32, 128 and 384 tokens sent
one at a time with one output token, and a phase of prompts beside 4 streams
decoding, in phases without a router and with one following the feed, alternating;
the step times are the worker's own step log's. The figure is each condition's step
time P50 less the P50 without a subscriber, in the same run.

The router is this checkout's (it streams, `/pd/kv/stream`). With
`PDSERVE_BENCH_POLL_PYTHON` naming the interpreter of a checkout whose router
long-polls (`/pd/kv/events`, one request per step), that router is a third
condition, against the same worker. `PDSERVE_BENCH_FEED_ROUNDS` (default 3) and
`PDSERVE_BENCH_FEED_PROMPTS` (per length and phase, default 20) size the run."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.base.process import ServerProcess, death_signal
from pdserve.workers.server.process import running_worker
from support.kv_pool import routing_file, wait_synced
from support.results import publish
from support.step_log import Step, read_steps, step_logging_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

LENGTHS = (32, 128, 384)
STREAMS = 4
STREAM_TOKENS = 48
BESIDE_TOKENS = 128  # the prompts sent while the streams decode
ROUNDS = int(os.environ.get("PDSERVE_BENCH_FEED_ROUNDS", "3"))
PROMPTS = int(os.environ.get("PDSERVE_BENCH_FEED_PROMPTS", "20"))
POLL_PYTHON = os.environ.get("PDSERVE_BENCH_POLL_PYTHON")
CREDENTIAL = "kv-feed-bench-credential-0123456789abcdef"


class Prompts:
    """Prompts no earlier one shares a block with (each stores its blocks anew)."""

    def __init__(self) -> None:
        self._generator = torch.Generator().manual_seed(7)

    def take(self, tokens: int) -> list[int]:
        return torch.randint(3, 4000, (tokens,), generator=self._generator).tolist()


def complete(url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        answer.read()


@contextmanager
def subscriber(condition: str, table: Path, credential: Path, log: Path) -> Iterator[str | None]:
    """A router of `condition` following the worker's feed, its URL (None: no router,
    for "none")."""
    if condition == "none":
        yield None
        return
    python = sys.executable if condition == "stream" else POLL_PYTHON
    assert python is not None
    port_file = log.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    args = ["router", "--config", str(table), "--internal-token-file", str(credential)]
    args += ["--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [python, "-m", "pdserve.cli", *args], stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=death_signal(),
        )  # fmt: skip
    router = ServerProcess(process, "127.0.0.1", port_file, log)
    try:
        router.wait_ready()
        yield router.url
    finally:
        router.stop()


def run_phase(url: str, prompts: Prompts, log: Path) -> dict[str, list[Step]]:
    """The phase's requests; the steps each part ran, by part."""
    steps: dict[str, list[Step]] = {}
    seen = len(read_steps(log))
    for length in LENGTHS:
        for _ in range(PROMPTS):
            complete(url, prompts.take(length), 1)
        now = read_steps(log)
        steps[str(length)] = now[seen:]
        seen = len(now)
    stop = threading.Event()
    decoding = [prompts.take(32) for _ in range(STREAMS * 64)]

    def stream(index: int) -> None:
        turn = 0
        while not stop.is_set():
            complete(url, decoding[(index * 64 + turn) % len(decoding)], STREAM_TOKENS)
            turn += 1

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(PROMPTS):
            complete(url, prompts.take(BESIDE_TOKENS), 1)
            complete(url, prompts.take(8), 1)  # a gap: decode-only steps between
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    steps["streams"] = read_steps(log)[seen:]
    return steps


def figures(steps: dict[str, list[Step]]) -> dict[str, float | None]:
    """Step time P50 per part: prompt steps alone (by length); with streams, steps
    with a prompt chunk beside decodes, and decode-only steps."""
    found: dict[str, float | None] = {}
    for length in LENGTHS:
        alone = [s.took_ms for s in steps[str(length)] if s.prompt_tokens and not s.decodes]
        found[f"prompt {length}"] = _p50(alone)
    beside = [s.took_ms for s in steps["streams"] if s.prompt_tokens >= BESIDE_TOKENS]
    found["prompt beside 4 streams"] = _p50(beside)
    found["decode-only, 4 streams"] = _p50(
        [s.took_ms for s in steps["streams"] if not s.prompt_tokens and s.decodes >= 2]
    )
    return found


def _less(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else value - base


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def test_a_kv_feed_subscriber_costs_the_workers_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    conditions = ["none", "stream"] + (["poll"] if POLL_PYTHON else [])
    credential = tmp_path / "credential"
    credential.write_text(CREDENTIAL)
    args = [
        "--threads", "1", "--served-model-name", "small", "--internal-token-file",
        str(credential), "--allow-direct-clients",
    ]  # fmt: skip
    log = tmp_path / "worker.log"
    samples: dict[str, list[dict[str, list[Step]]]] = {c: [] for c in conditions}
    server_cpu = dict.fromkeys(conditions, 0.0)
    prompts = Prompts()
    env = step_logging_env()
    with running_worker(tiny_model_dir, log, args, env=env) as worker:
        table = routing_file(tmp_path, tiny_model_dir, [worker.url])
        run_phase(worker.url, prompts, log)  # warm-up, not counted
        for round_ in range(ROUNDS):
            order = conditions if round_ % 2 == 0 else conditions[::-1]
            for condition in order:
                router_log = tmp_path / f"router-{condition}-{round_}.log"
                with subscriber(condition, table, credential, router_log) as router_url:
                    if router_url is not None:
                        wait_synced(router_url, [worker.url])
                    before = server_thread_cpu_s(worker.process.pid)
                    samples[condition].append(run_phase(worker.url, prompts, log))
                    server_cpu[condition] += server_thread_cpu_s(worker.process.pid) - before
    merged = {
        condition: {part: [step for phase in phases for step in phase[part]] for part in phases[0]}
        for condition, phases in samples.items()
    }
    table_rows: list[dict[str, Any]] = []
    base = figures(merged["none"])
    for part, none_ms in base.items():
        row: dict[str, Any] = {"part": part, "none P50 ms": none_ms}
        for condition in conditions[1:]:
            value = figures(merged[condition])[part]
            row[f"{condition} P50 ms"] = value
            row[f"{condition} added ms"] = _less(value, none_ms)
            # Each round's own difference (its phases ran next to each other).
            row[f"{condition} added by round"] = " ".join(
                f"{d:+.2f}" if (d := _less(figures(on)[part], figures(off)[part])) is not None
                else "-"
                for on, off in zip(samples[condition], samples["none"], strict=True)
            )  # fmt: skip
        row["steps (none)"] = _count(merged["none"], part)
        table_rows.append(row)
    # The worker's serving thread (its event loop: the completions, and the feed) in
    # CPU ms per engine step: the steps run the same requests in every condition.
    steps_run = {c: sum(len(part) for phase in samples[c] for part in phase.values())
                 for c in conditions}  # fmt: skip
    per_step = {c: round(1e3 * server_cpu[c] / max(1, steps_run[c]), 3) for c in conditions}
    extra = {"rounds": ROUNDS, "prompts": PROMPTS, "server thread CPU ms per step": per_step}
    publish("kv_feed_cost", table_rows, extra)


def server_thread_cpu_s(pid: int) -> float:
    """CPU seconds the process's main thread (the worker's event loop) has used."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _count(steps: dict[str, list[Step]], part: str) -> int:
    if part.startswith("prompt ") and part.split()[1].isdigit():
        return sum(1 for s in steps[part.split()[1]] if s.prompt_tokens and not s.decodes)
    if part.startswith("prompt beside"):
        return sum(1 for s in steps["streams"] if s.prompt_tokens >= BESIDE_TOKENS)
    return sum(1 for s in steps["streams"] if not s.prompt_tokens and s.decodes >= 2)
