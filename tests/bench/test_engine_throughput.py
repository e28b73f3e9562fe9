"""Engine throughput on the tiny model: prefill tokens/s by prompt length and decode
tokens/s by batch size, measured on the engine itself (no HTTP). Run with `make bench`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.config import EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DECODE_STEPS = 64


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 4000, (length,), generator=generator).tolist()


def prefill_rate(engine: LLMEngine, length: int) -> float:
    engine.add_request(f"prefill-{length}", prompt(length, length), SamplingParams(max_tokens=1))
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += engine.step().stats.num_tokens
    return tokens / (time.perf_counter() - started)


def decode_rate(engine: LLMEngine, batch: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"decode-{batch}-{index}", prompt(128, index), params)
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    started, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_unfinished():
        tokens += len(engine.step().outputs)
        steps += 1
    elapsed = time.perf_counter() - started
    return tokens / elapsed, elapsed / steps


def engine_with_budget(model_dir: Path, budget: int) -> LLMEngine:
    config = EngineConfig(
        model_dir=model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=budget)
    )
    return LLMEngine(config)


@pytest.mark.parametrize("threads", [1])
def test_engine_throughput(tiny_model_dir: Path, threads: int) -> None:
    torch.set_num_threads(threads)
    engine = engine_with_budget(tiny_model_dir, 2048)
    rows: list[dict[str, object]] = []
    for length in (128, 512, 2048, 8192):
        rows.append(
            {"phase": "prefill", "size": length, "tokens_per_s": prefill_rate(engine, length)}
        )
    # A prompt alone, in chunks of 256: what chunking costs its TTFT on an idle engine.
    chunked = engine_with_budget(tiny_model_dir, 256)
    for length in (2048, 8192):
        rate = prefill_rate(chunked, length)
        rows.append({"phase": "prefill/256-token chunks", "size": length, "tokens_per_s": rate})
    for batch in (1, 8, 32, 64):
        rate, step_s = decode_rate(engine, batch)
        rows.append(
            {"phase": "decode", "size": batch, "tokens_per_s": rate, "ms_per_step": step_s * 1e3}
        )
    publish("engine_throughput", rows, {"threads": threads, "model": str(tiny_model_dir)})
    decode = {
        row["size"]: float(str(row["tokens_per_s"])) for row in rows if row["phase"] == "decode"
    }
    # Continuous batching pays: 32 sequences decode far faster together than one.
    assert decode[32] > 3 * decode[1]
