"""How much of a disaggregated request's TTFT goes to moving its KV cache: prompts
of 512, 2048 and 8192 tokens, on the tiny model and on a model whose KV is 32 KiB per
token, over NIXL between a prefill and a decode process. Run with `make bench`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from pdserve.workers.engine.config import ModelConfig
from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint
from support.pd import complete, pd_workers
from support.results import publish
from support.worker import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT_LENGTHS = (512, 2048, 8192)
# 16 layers x 8 KV heads x 32 dims x K and V x 4 bytes = 32 KiB per token.
KV_32K_SPEC = TinyModelSpec(layers=16, hidden=256, heads=8, kv_heads=8, intermediate=704)


@pytest.fixture(scope="module")
def kv_32k_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "kv32k"
    write_tiny_checkpoint(directory, KV_32K_SPEC)
    assert ModelConfig.from_dir(directory).kv_bytes_per_token == 32 * 1024
    return directory


async def timed_completion(decode_url: str, prefill_url: str, tokens: list[int]) -> float:
    """Seconds to the (only) token of a one-token disaggregated completion."""
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        status, answer = await complete(session, decode_url, tokens, prefill_url, max_tokens=1)
        assert status == 200, answer
        return time.perf_counter() - started


def measure(model_dir: Path, logs: Path, backend: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    kv_per_token = ModelConfig.from_dir(model_dir).kv_bytes_per_token
    # Room for the longest prompt on both sides, and a budget that chunks it.
    sizing = ["--num-kv-blocks", "1100", "--max-num-batched-tokens", "2048"]
    with pd_workers(model_dir, logs, backend, prefill_args=sizing, decode_args=sizing) as pd:
        decode, prefill = pd.decode[0], pd.prefill[0]
        # The first hand-off of a pair also connects the agents: keep that out.
        asyncio.run(timed_completion(decode.url, prefill.url, list(range(3, 40))))
        for length in PROMPT_LENGTHS:
            prompt = torch.randint(
                3, 4000, (length,), generator=torch.Generator().manual_seed(length)
            )
            moved_before = metric(prefill, "pdserve_kv_transfer_duration_seconds_sum")

            ttft = asyncio.run(timed_completion(decode.url, prefill.url, prompt.tolist()))
            transfer = metric(prefill, "pdserve_kv_transfer_duration_seconds_sum") - moved_before
            rows.append(
                {
                    "model": model_dir.name,
                    "kv_per_token_kib": kv_per_token / 1024,
                    "prompt_tokens": length,
                    "kv_mib": length * kv_per_token / 2**20,
                    "ttft_ms": ttft * 1e3,
                    "transfer_ms": transfer * 1e3,
                    "transfer_share_of_ttft": transfer / ttft,
                }
            )
    return rows


def test_transfer_share_of_ttft(tiny_model_dir: Path, kv_32k_model: Path, tmp_path: Path) -> None:
    rows = measure(tiny_model_dir, tmp_path / "tiny", "nixl")
    rows += measure(kv_32k_model, tmp_path / "kv32k", "nixl")
    publish("handoff_ttft_share", rows, {"backend": "nixl"})
    assert all(float(str(row["transfer_share_of_ttft"])) < 0.5 for row in rows)
