"""Prefill attention over a cached prefix: one masked call against the split one (the
cached keys unmasked with each KV head's queries stacked, the chunk's own keys causal,
merged exactly), on the tiny model's shapes (8 heads of 32, 2 KV heads, one torch
thread). Two tables: the attention of one layer per (chunk, cached) size, and whole
engine steps (the step's own duration, as the step log reports it): a hit's chunk over
8,992 cached tokens, and the short prompts and decodes that take the unchanged path.
The two ways alternate round by round in one process. Run with `make bench`, or
`pytest tests/bench/test_prefill_attention.py -m slow -s`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine import attention
from pdserve.workers.engine.config import EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 32, 16
SIZES = ((300, 9000), (110, 9000), (512, 9000), (48, 9000), (16, 9000), (4, 9000),
         (300, 4096), (110, 4096), (512, 4096), (16, 4096),
         (300, 2048), (128, 2048), (512, 1024), (128, 512), (32, 512))  # fmt: skip
ATTENTION_ROUNDS = int(os.environ.get("PDSERVE_BENCH_ATTENTION_ROUNDS", "9"))
STEP_ROUNDS = int(os.environ.get("PDSERVE_BENCH_ATTENTION_STEP_ROUNDS", "10"))
PREFIX = 8992  # cached tokens a hit finds (whole blocks)


@contextmanager
def way(name: str) -> Iterator[None]:
    """The masked call whatever the sizes for "one call"; as the module says otherwise."""
    kept = attention.SPLIT_MIN_CACHED
    if name == "one call":
        attention.SPLIT_MIN_CACHED = 1 << 30
    try:
        yield
    finally:
        attention.SPLIT_MIN_CACHED = kept


def alternate(calls: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each call's milliseconds per round, the order flipped every round (after one
    untimed call each)."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        with way(name):
            calls[name]()
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            with way(name):
                times[name].append(calls[name]())
    return times


def attention_rows() -> list[dict[str, object]]:
    generator = torch.Generator().manual_seed(0)
    blocks = 1200
    kv_layer = torch.randn(blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    rows: list[dict[str, object]] = []
    for chunk, cached in SIZES:
        context = chunk + cached
        table = torch.randperm(blocks, generator=generator)[: -(-context // BLOCK)]
        segment = attention.PrefillSegment(0, chunk, context, table)
        query = torch.randn(chunk, HEADS, HEAD_DIM, generator=generator)

        def once(query: torch.Tensor = query, segment: attention.PrefillSegment = segment) -> float:
            started = time.perf_counter()
            attention._prefill_attention(query, kv_layer, segment, HEAD_DIM**-0.5)
            return 1e3 * (time.perf_counter() - started)

        kept = attention.SPLIT_MIN_CACHED, attention.SPLIT_MIN_CHUNK
        # Split whatever the sizes, to see where it pays.
        attention.SPLIT_MIN_CACHED = attention.SPLIT_MIN_CHUNK = 1
        try:
            split = alternate({"one call": once, "split": once}, ATTENTION_ROUNDS)
        finally:
            attention.SPLIT_MIN_CACHED, attention.SPLIT_MIN_CHUNK = kept
        before, after = statistics.median(split["one call"]), statistics.median(split["split"])
        rows.append({
            "chunk": chunk, "cached": cached, "one_call_ms": before, "split_ms": after,
            "speedup": before / after,
            "engine_splits": cached >= attention.SPLIT_MIN_CACHED
            and attention.SPLIT_MIN_CHUNK <= chunk <= attention.SPLIT_MAX_CHUNK,
        })  # fmt: skip
    return rows


def step_rows(model_dir: Path) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    engine = LLMEngine(
        EngineConfig(model_dir=model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=512))
    )
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 4000, (PREFIX,), generator=generator).tolist()
    served = 0

    def prompt_step(tokens: list[int]) -> float:
        """The duration of the step that computes `tokens`' uncached part (one chunk)."""
        nonlocal served
        served += 1
        engine.add_request(f"p{served}", tokens, SamplingParams(max_tokens=1, temperature=0.0))
        took = engine.step().stats.duration_s
        while engine.has_unfinished():
            engine.step()
        return 1e3 * took

    def fresh(length: int) -> list[int]:
        return torch.randint(3, 4000, (length,), generator=generator).tolist()

    def decode_step() -> float:
        """A step of 4 decoding sequences (128-token prompts)."""
        nonlocal served
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for _ in range(4):
            served += 1
            engine.add_request(f"d{served}", fresh(128), params)
        while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        took = engine.step().stats.duration_s
        while engine.has_unfinished():
            engine.step()
        return 1e3 * took

    # Warm the prefix into the cache (chunks of 512), then every hit finds it.
    engine.add_request("warm", prefix + fresh(8), SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    cases: dict[str, Callable[[], float]] = {
        f"hit: 300 over {PREFIX} cached": lambda: prompt_step(prefix + fresh(300)),
        f"hit: 110 over {PREFIX} cached": lambda: prompt_step(prefix + fresh(110)),
        f"hit: 16 over {PREFIX} cached": lambda: prompt_step(prefix + fresh(16)),
        "prompt 32": lambda: prompt_step(fresh(32)),
        "prompt 128": lambda: prompt_step(fresh(128)),
        "decode-only, 4 sequences": decode_step,
    }
    rows: list[dict[str, object]] = []
    for case, call in cases.items():
        times = alternate({"one call": call, "split": call}, STEP_ROUNDS)
        before, after = statistics.median(times["one call"]), statistics.median(times["split"])
        rows.append({"step": case, "one_call_ms": before, "split_ms": after,
                     "added_ms": after - before})  # fmt: skip
    return rows


def test_prefill_attention(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    sizes = attention_rows()
    publish("prefill_attention", sizes, {"rounds": ATTENTION_ROUNDS, "statistic": "median"})
    steps = step_rows(tiny_model_dir)
    publish("prefill_attention_steps", steps, {"rounds": STEP_ROUNDS, "statistic": "median"})
    assert all(row["one_call_ms"] > 0 for row in sizes + steps)  # type: ignore[operator]
