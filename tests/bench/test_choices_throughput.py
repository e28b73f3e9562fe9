"""n = 8 against 8 separate requests with the same prompt, on the tiny model (no
HTTP): generated tokens per second and KV blocks, in the same run. The 8 requests
arrive together, as a client sending them at once would; the prefix cache is on, as
by default. Run with `make bench`."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.workers.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.sampling import SamplingParams
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

N = 8
PROMPT_LEN = 1000  # 62 full blocks of 16 and a partial one
MAX_TOKENS = 64
ROUNDS = 3  # each way, alternated, so drift in the machine's speed hits both alike


def engine(model_dir: Path) -> LLMEngine:
    config = EngineConfig(
        model_dir=model_dir,
        cache=CacheConfig(num_blocks=1024),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
    )
    return LLMEngine(config)


def run(
    engine: LLMEngine, requests: dict[str, SamplingParams], prompt: list[int]
) -> dict[str, float]:
    """Serve the requests to the end; tokens/s, and KV blocks allocated and held at most."""
    allocated = engine.kv_cache.pool.num_allocated_total
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    started, tokens, peak = time.perf_counter(), 0, 0.0
    while engine.has_unfinished():
        result = engine.step()
        tokens += sum(len(output.new_token_ids) for output in result.outputs)
        peak = max(peak, result.stats.kv_cache_usage)
    elapsed = time.perf_counter() - started
    assert tokens == N * MAX_TOKENS and engine.kv_cache.pool.usage == 0.0
    return {
        "tokens_per_s": tokens / elapsed,
        "seconds": elapsed,
        "blocks_allocated": engine.kv_cache.pool.num_allocated_total - allocated,
        "peak_blocks": round(peak * engine.kv_cache.pool.num_blocks),
    }


def test_n_against_separate_requests(tiny_model_dir: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, ignore_eos=True)
    measured: dict[str, list[dict[str, float]]] = {"n=8": [], "8 requests": []}
    for round_ in range(ROUNDS):
        # A fresh prompt and engine each time: nothing cached from an earlier run.
        prompt = torch.randint(3, 4000, (PROMPT_LEN,), generator=generator).tolist()
        forked = {f"n-{round_}": replace(params, n=N)}
        measured["n=8"].append(run(engine(tiny_model_dir), forked, prompt))
        separate = {f"r-{round_}-{i}": params.choice(i) for i in range(N)}
        measured["8 requests"].append(run(engine(tiny_model_dir), separate, prompt))
    rows = [
        {
            "way": way,
            "tokens_per_s": sorted(r["tokens_per_s"] for r in runs)[ROUNDS // 2],
            "blocks_allocated": runs[0]["blocks_allocated"],
            "peak_blocks": runs[0]["peak_blocks"],
        }
        for way, runs in measured.items()
    ]
    forked_row, separate_row = rows
    ratio = float(forked_row["tokens_per_s"]) / float(separate_row["tokens_per_s"])
    extra = {"prompt_tokens": PROMPT_LEN, "max_tokens": MAX_TOKENS, "n": N}
    publish("choices_throughput", rows, {**extra, "throughput_ratio": ratio, "rounds": measured})
    # The prompt's 63 blocks once, against once per request (they arrive together,
    # before any of them has registered its blocks in the prefix cache).
    assert forked_row["blocks_allocated"] < separate_row["blocks_allocated"]
    assert ratio > 1.0
