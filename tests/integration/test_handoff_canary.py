"""No KV write lands in a block its writer no longer owns, for both transfer
backends. The decode worker's free blocks hold a pattern (the KV canary, see
engine/canary.py); the prefill worker's write is stalled right where its bytes go
out, past the client's disconnect and past the lease; afterwards no free block has
changed, and the requests that took blocks meanwhile computed right."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine import canary
from pdserve.workers.faults import Fault
from support.engine import make_engine, run_to_completion
from support.pd import PDPair, complete, fault_fired, pd_workers, token_ids, wait_for_log
from support.worker import metric

LEASE_S = 2.0
STALL_S = LEASE_S + 0.5  # the write lands after the lease, before its margin ends
NUM_BLOCKS = 12  # of 16 tokens: a hand-off's blocks held back leave too few for another
POINT = "kv_transfer.before_post"


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def colocated(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return run_to_completion(make_engine(model_dir), [prompt], params)[0][0]


async def leave_mid_write(workers: PDPair, handed: list[int]) -> None:
    """Send a hand-off and disconnect once the prefill worker's write is stalled."""
    decode, prefill = workers.decode[0], workers.prefill[0]
    async with aiohttp.ClientSession() as session:
        call = asyncio.ensure_future(complete(session, decode.url, handed, prefill.url))
        await wait_for_log(prefill, fault_fired(POINT))
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)


async def one(
    workers: PDPair, prompt: list[int], prefill: bool, max_tokens: int
) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session:
        url = workers.prefill[0].url if prefill else None
        return await complete(session, workers.decode[0].url, prompt, url, max_tokens=max_tokens)


@pytest.mark.parametrize("backend", ["nixl", "torch"])
def test_a_late_write_never_lands_in_freed_or_reused_blocks(
    backend: str, small_model_dir: Path, tmp_path: Path
) -> None:
    handed, other, expired = prompt_of(96, 1), prompt_of(80, 2), prompt_of(96, 3)
    other_tokens = colocated(small_model_dir, other, 64)
    expired_tokens = colocated(small_model_dir, expired, 8)
    decode_args = [
        "--num-kv-blocks", str(NUM_BLOCKS), "--handoff-timeout", str(LEASE_S),
        "--transfer-failure-policy", "recompute",
    ]  # fmt: skip
    with pd_workers(
        small_model_dir, tmp_path, backend, decode_args=decode_args,
        prefill_faults={POINT: Fault(delay_s=STALL_S)},
        decode_env={canary.ENV: "1234.5"},
    ) as workers:  # fmt: skip
        decode, prefill = workers.decode[0], workers.prefill[0]
        # The client leaves while the write is stalled; another request then needs
        # more blocks than those left free.
        asyncio.run(leave_mid_write(workers, handed))
        status, answer = asyncio.run(one(workers, other, prefill=False, max_tokens=64))
        assert status == 200 and token_ids(answer) == other_tokens
        if backend == "torch":
            # That write ran past the prefill worker's own deadline, and gloo closes
            # a connection whose wait times out: the pair is gone, which the next
            # hand-off learns (and recomputes), meeting again after it.
            status, answer = asyncio.run(one(workers, expired, prefill=True, max_tokens=8))
            assert status == 200 and token_ids(answer) == expired_tokens
            assert metric(decode, "pdserve_kv_transfer_failures_total", reason="unknown_peer") == 1
        # The lease runs out while the write is stalled: the request is prefilled
        # here instead, in blocks its late write must not reach.
        status, answer = asyncio.run(one(workers, expired, prefill=True, max_tokens=8))
        assert status == 200 and token_ids(answer) == expired_tokens
        assert metric(decode, "pdserve_kv_transfer_failures_total", reason="lease_expired") == 1
        assert prefill.log().count(fault_fired(POINT)) == 2  # both writes went out late
    # Stopping the worker sweeps every free block.
    log = decode.log()
    assert "KV canary on" in log
    assert canary.MESSAGE.split("%d")[0] not in log, log
