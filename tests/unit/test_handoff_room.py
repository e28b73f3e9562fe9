"""A hand-off's tries to reserve its prompt's blocks on a full decode worker
(`handoff.decode.RoomWait`), on a real engine."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import cast

from prometheus_client import CollectorRegistry

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.async_engine import AsyncEngine
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.handoff.decode import DecodeHandoff, RoomWait
from pdserve.workers.kv_transfer.base import KVTransferAgent
from pdserve.workers.server.metrics import WorkerMetrics
from support.engine import make_engine

BLOCKS = 8  # of 16 tokens
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def wait_for(prompt_tokens: int, name: str = "handed") -> RoomWait:
    return RoomWait(name, list(range(3, 3 + prompt_tokens)), PARAMS, lease_s=30.0, margin_s=5.0)


def test_a_try_looks_again_only_once_more_blocks_are_free(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir, num_blocks=BLOCKS)
    engine.add_request("running", list(range(500, 580)), PARAMS)  # 80 tokens: 5 blocks
    engine.step()
    room = wait_for(64)  # 4 blocks: 3 are free

    assert room.try_reserve(engine) is None and room.attempts == 1
    assert room.try_reserve(engine) is None and room.attempts == 1  # nothing freed
    while engine.has_unfinished():
        engine.step()
    reservation = room.try_reserve(engine)
    assert reservation is not None and room.attempts == 2
    assert len(reservation.block_ids) == 4 and not room.never


def test_a_prompt_larger_than_the_whole_cache_never_waits(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir, num_blocks=BLOCKS)
    room = wait_for(BLOCKS * 16 + 1)

    assert room.try_reserve(engine) is None
    assert room.never and room.attempts == 0


def test_a_prompt_held_but_a_few_tokens_is_left_to_prefill_here(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir, num_blocks=BLOCKS)
    history = list(range(3, 3 + 64))  # four blocks, cached once answered
    engine.add_request("history", history, PARAMS)
    while engine.has_unfinished():
        engine.step()
    prompt = [*history, *range(900, 910)]  # ten tokens more: 64 of 74 are cached

    here = RoomWait("here", prompt, PARAMS, lease_s=30.0, margin_s=5.0, local_tokens=10)
    assert here.try_reserve(engine) is None
    assert here.local and here.attempts == 0 and not engine.leases
    handed = RoomWait("handed", prompt, PARAMS, lease_s=30.0, margin_s=5.0, local_tokens=9)
    reservation = handed.try_reserve(engine)
    assert reservation is not None and not handed.local
    assert reservation.num_cached_tokens == 64  # the hand-off moves only the rest


async def test_a_wait_the_client_left_keeps_no_blocks(small_model_dir: Path) -> None:
    # The engine thread is busy while the hand-off's try is queued; the client leaves
    # (the task is cancelled); the engine then makes the try, which reserves: the
    # blocks must go back at once, not after the lease.
    engine = make_engine(small_model_dir, num_blocks=BLOCKS)
    served = AsyncEngine(engine)
    metrics = WorkerMetrics("pool", "decode", CollectorRegistry())
    # No transfer happens here: the wait for room comes before any.
    handoff = DecodeHandoff(served, cast(KVTransferAgent, None), metrics, room_wait_s=5.0)
    busy, go_on = threading.Event(), threading.Event()

    def hold(_: LLMEngine) -> None:
        busy.set()
        go_on.wait(30)

    served.start()
    try:
        held = asyncio.ensure_future(served.call(hold))
        await asyncio.to_thread(busy.wait, 30)
        waiting = asyncio.ensure_future(handoff._reserve(wait_for(32, "left")))
        await asyncio.sleep(0.05)  # its try is queued behind the busy call
        waiting.cancel()
        go_on.set()
        await held
        assert await served.call(lambda e: (len(e.leases), e.kv_cache.pool.num_free)) == (
            0, BLOCKS,
        )  # fmt: skip
    finally:
        go_on.set()
        served.stop()
        await handoff.close()
