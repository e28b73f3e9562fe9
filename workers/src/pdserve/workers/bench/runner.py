"""The driver of a run: sends each planned request at its time and collects the records.

A run is bounded: requests are sent until the plan ends (its duration or request
count), then the ones still streaming get a drain timeout; whatever is still open
at that deadline is cancelled and counted as failed, so a stuck server cannot hang
the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from pdserve.workers.bench.client import CompletionsClient, fetch_model_id
from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.metrics import BenchMetrics, compute_metrics
from pdserve.workers.bench.plan import PlannedRequest, build_plan, planned_prompt
from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.model.tokenizer import Tokenizer

# Time between building the session and the first arrival, so the first request is
# not late because of set-up work.
_START_DELAY_S = 0.05


@dataclass(frozen=True)
class BenchResult:
    """The outcome of a run: its configuration, the raw records and the figures."""

    config: BenchConfig
    model: str
    started_at: float  # perf_counter at the run's time zero
    wall_start: datetime
    records: list[RequestRecord]
    metrics: BenchMetrics
    # CPU time of the thread that ran the generator's event loop: the generator's
    # own cost, to check that it was not the bottleneck.
    generator_cpu_s: float


def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run a benchmark to its end (blocking); see `arun_benchmark`."""
    return asyncio.run(arun_benchmark(config))


async def arun_benchmark(config: BenchConfig) -> BenchResult:
    """Run a benchmark to its end from inside an event loop.

    Raises `ServerError` when the model must be discovered and the server cannot
    be asked; failures of individual requests are recorded, not raised.
    """
    cpu_before = time.thread_time()
    plan = build_plan(config)
    connector = aiohttp.TCPConnector(limit=config.concurrency_limit or 0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = config.model or await fetch_model_id(session, config.url)
        client = CompletionsClient(session, config.url, model, config.ignore_eos)
        started_at = time.perf_counter() + _START_DELAY_S
        wall_start = datetime.now(UTC)
        records = await _drive(config, plan, client, started_at)
    cpu_s = time.thread_time() - cpu_before
    metrics = compute_metrics(records, started_at, config.slo, config.buckets)
    return BenchResult(config, model, started_at, wall_start, records, metrics, cpu_s)


async def _drive(
    config: BenchConfig, plan: list[PlannedRequest], client: CompletionsClient, started_at: float
) -> list[RequestRecord]:
    slots = asyncio.Semaphore(config.concurrency_limit) if config.concurrency_limit else None
    last_offset = plan[-1].offset_s if plan else 0.0
    deadline = started_at + max(config.horizon_s or 0.0, last_offset) + config.drain_timeout_s
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    for planned in plan:
        due = started_at + planned.offset_s
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = RequestRecord(
            planned.index, planned.kind, planned.input_tokens, planned.output_tokens, due
        )
        records.append(record)
        prompt = _as_sent(config, planned_prompt(config, planned))
        tasks.append(asyncio.create_task(_send(client, record, prompt, slots)))
    await _drain(tasks, records, deadline)
    return records


async def _send(
    client: CompletionsClient,
    record: RequestRecord,
    prompt: list[int] | str,
    slots: asyncio.Semaphore | None,
) -> None:
    if slots is None:
        await client.send(record, prompt)
        return
    async with slots:
        await client.send(record, prompt)


def _as_sent(config: BenchConfig, prompt: list[int] | str) -> list[int] | str:
    """Token ids as text where the server takes no token-id prompts (`text_prompts`)."""
    if config.text_prompts is not None and isinstance(prompt, list):
        return _tokenizer(config.text_prompts).decode(prompt)
    return prompt


@functools.cache
def _tokenizer(directory: Path) -> Tokenizer:
    return Tokenizer.from_dir(directory)


async def _drain(
    tasks: list[asyncio.Task[None]], records: list[RequestRecord], deadline: float
) -> None:
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    now = time.perf_counter()
    for task, record in zip(tasks, records, strict=True):
        if not task.done():
            task.cancel()
            record.fail("unfinished at the drain deadline", now)
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
