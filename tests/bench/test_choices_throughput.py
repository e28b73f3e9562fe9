"""n = 8 against 8 separate requests with the same prompt, on the tiny model (no
HTTP): generated tokens per second and KV blocks, in the same run. The 8 requests
arrive together, as a client sending them at once would; the prefix cache is on, as
by default, so the requests admitted after the first step find the prompt there: what
n saves over them is the prompt computed by those admitted with the first (as many
as the step's budget holds) and the blocks they allocate. Run with `make bench`."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

N = 8
PROMPT_LENS = (1000, 4010)  # not multiples of the block size: the fork copies a block
MAX_TOKENS = 64
ROUNDS = 5  # each way, alternated, so drift in the machine's speed hits both alike


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
    assert tokens == len(requests) * MAX_TOKENS * (N if len(requests) == 1 else 1)
    assert engine.kv_cache.pool.usage == 0.0
    return {
        "tokens_per_s": tokens / elapsed,
        "seconds": elapsed,
        "blocks_allocated": engine.kv_cache.pool.num_allocated_total - allocated,
        "peak_blocks": round(peak * engine.kv_cache.pool.num_blocks),
    }


@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
def test_n_against_separate_requests(tiny_model_dir: Path, prompt_len: int) -> None:
    generator = torch.Generator().manual_seed(prompt_len)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, ignore_eos=True)
    measured: dict[str, list[dict[str, float]]] = {"n=8": [], "8 requests": []}
    for round_ in range(ROUNDS):
        # A fresh prompt and engine each time: nothing cached from an earlier run.
        prompt = torch.randint(3, 4000, (prompt_len,), generator=generator).tolist()
        forked = {f"n-{round_}": replace(params, n=N)}
        measured["n=8"].append(run(engine(tiny_model_dir), forked, prompt))
        separate = {f"r-{round_}-{i}": params.choice(i) for i in range(N)}
        measured["8 requests"].append(run(engine(tiny_model_dir), separate, prompt))
    rows: list[dict[str, Any]] = [
        {
            "way": way,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "blocks_allocated": runs[0]["blocks_allocated"],
            "peak_blocks": runs[0]["peak_blocks"],
        }
        for way, runs in measured.items()
    ]
    forked_row, separate_row = rows
    ratio = float(forked_row["tokens_per_s"]) / float(separate_row["tokens_per_s"])
    extra = {"prompt_tokens": prompt_len, "max_tokens": MAX_TOKENS, "n": N, "rounds": measured}
    publish(f"choices_throughput_{prompt_len}", rows, {**extra, "throughput_ratio": ratio})
    # Deterministic: the prompt's blocks once (and a copy of its partial block per
    # choice), against once per request admitted before the prompt was cached.
    prompt_blocks = -(-prompt_len // 16)
    assert forked_row["blocks_allocated"] == prompt_blocks + (N - 1) + N * (
        -(-(prompt_len + MAX_TOKENS - 1) // 16) - prompt_blocks
    )
    assert separate_row["blocks_allocated"] > forked_row["blocks_allocated"]
    # Timing (this machine, shared): no worse than separate requests, within noise.
    assert ratio > 0.8
