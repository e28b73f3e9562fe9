"""The prefix cache's event log: what a block pool stores and evicts, numbered, with
a bounded replay buffer and a snapshot that agree with the pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.async_engine import AsyncEngine
from pdserve.workers.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.workers.engine.kv_events import KVEventLog, prefix_hashes, seed_fingerprint
from support.engine import make_engine

BLOCK = 4


def cache_with_log(blocks: int = 8, capacity: int = 1024) -> tuple[KVCacheManager, KVEventLog]:
    pool = BlockPool(blocks)
    log = KVEventLog(capacity)
    pool.prefix_watcher = log
    return KVCacheManager(pool, BLOCK), log


def compute(cache: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """A request prefilled whole, then finished (its blocks stay cached)."""
    cache.find_cached_prefix(request_id, tokens)
    assert cache.allocate(request_id, len(tokens))
    cache.cache_full_blocks(request_id, tokens, len(tokens))
    cache.free(request_id)


def replay(log: KVEventLog, seq: int, held: set[bytes]) -> int:
    found = log.since(log.epoch, seq)
    assert not found.gap
    for event in found.events:
        if event.kind == "stored":
            held.update(event.hashes)
        elif event.kind == "removed":
            held.difference_update(event.hashes)
        else:
            held.clear()
    return found.seq


def test_stored_blocks_are_the_prompts_full_blocks_by_the_routers_hashes() -> None:
    cache, log = cache_with_log()
    tokens = list(range(10))  # two full blocks and a partial one
    compute(cache, "a", tokens)
    assert set(log.snapshot().hashes) == set(prefix_hashes(tokens, BLOCK))
    assert len(prefix_hashes(tokens, BLOCK)) == 2


def test_a_subscriber_replaying_events_holds_what_the_snapshot_holds() -> None:
    cache, log = cache_with_log(blocks=4)
    held: set[bytes] = set()
    seq = 0
    for start in range(0, 60, 7):  # more prompts than blocks: evictions
        compute(cache, f"r{start}", list(range(start, start + 9)))
        seq = replay(log, seq, held)
    snapshot = log.snapshot()
    assert snapshot.seq == seq
    assert held == set(snapshot.hashes)
    assert len(held) <= 4


def test_a_subscriber_that_saw_part_of_a_folded_event_gets_the_rest() -> None:
    log = KVEventLog()
    log.stored(b"a" * 16)
    seen = log.since(log.epoch, 0)
    log.stored(b"b" * 16)  # folds into the event already read
    rest = log.since(log.epoch, seen.seq)
    assert [event.hashes for event in rest.events] == [(b"b" * 16,)]


def test_events_no_longer_kept_or_another_epoch_is_a_gap() -> None:
    log = KVEventLog(capacity=2)
    for kind in range(6):  # alternate kinds: no folding
        (log.stored if kind % 2 == 0 else log.removed)(bytes([kind]) * 16)
    assert log.since(log.epoch, 0).gap
    assert not log.since(log.epoch, 4).gap
    assert log.since("another", 4).gap
    assert log.since(log.epoch, 99).gap


def test_a_new_log_is_a_new_epoch() -> None:
    assert KVEventLog().epoch != KVEventLog().epoch


def test_a_reset_clears_only_an_idle_cache_and_says_so() -> None:
    cache, log = cache_with_log()
    compute(cache, "a", list(range(8)))
    assert cache.allocate("busy", 4)
    assert not cache.pool.reset_prefix_cache()
    cache.free("busy")
    assert cache.pool.reset_prefix_cache()
    assert log.snapshot().hashes == ()
    assert log.since(log.epoch, log.seq - 1).events[-1].kind == "cleared"
    assert cache.find_cached_prefix("again", list(range(9))) == 0


def test_a_hash_seed_renames_every_block_and_the_router_hashes_alike() -> None:
    tokens = list(range(10))
    seeded = KVCacheManager(BlockPool(8), BLOCK, hash_seed="pool-a")
    compute(seeded, "a", tokens)
    # Another cache with the same seed finds the prompt; the router's hashes name it.
    assert seeded.find_cached_prefix("b", tokens) == 2 * BLOCK
    assert seeded.pool.lookup(prefix_hashes(tokens, BLOCK, "pool-a")[1]) is not None
    # No seed, or another seed: the same tokens are other blocks.
    others = {s: prefix_hashes(tokens, BLOCK, s) for s in ("", "pool-b")}
    assert all(seeded.pool.lookup(h) is None for hashes in others.values() for h in hashes)
    assert seed_fingerprint("") == "" and seed_fingerprint("pool-a") != seed_fingerprint("b")
    assert "pool-a" not in seed_fingerprint("pool-a")


def test_a_waiting_reader_is_told_once_per_publish_not_per_block() -> None:
    cache, log = cache_with_log()
    told: list[int] = []
    log.on_change = lambda: told.append(log.seq)
    compute(cache, "a", list(range(12)))  # three full blocks
    assert told == []
    log.publish()
    log.publish()  # nothing new since
    assert told == [3]
    found = log.since(log.epoch, 0)
    assert [len(event.hashes) for event in found.events] == [3]  # one answer holds them all


def test_a_serving_engine_tells_its_readers_once_per_step_with_the_whole_steps_blocks(
    small_model_dir: Path,
) -> None:
    """A prompt of 8 blocks prefilled in two chunks of 4: the server is woken twice,
    each time with a whole chunk's blocks (not at each block, mid-step)."""
    engine = make_engine(small_model_dir, budget=64)
    log = KVEventLog()
    engine.kv_cache.pool.prefix_watcher = log
    told: list[int] = []
    log.on_change = lambda: told.append(log.seq)
    served = AsyncEngine(engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def serve() -> None:
        async for _ in served.generate(list(range(1, 129)), params):
            pass

    served.start()
    try:
        asyncio.run(serve())
    finally:
        served.stop()
    assert engine.block_size == 16
    assert told == [4, 8]
