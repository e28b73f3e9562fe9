"""Block pool and block tables: reference counts, prefix hashes, LRU eviction."""

from __future__ import annotations

import pytest

from pdserve.workers.engine.kv_cache import BlockPool, KVCacheManager, hash_block


def test_hashes_chain_to_the_parent() -> None:
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == first
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])


def test_allocate_and_release_return_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks is not None and len(set(blocks)) == 3
    assert pool.allocate(2) is None  # all or nothing
    assert pool.num_free == 1
    pool.release(blocks)
    assert pool.num_free == 4 and pool.usage == 0.0


def test_release_more_than_acquired_is_a_bug() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.release(blocks)
    with pytest.raises(AssertionError):
        pool.release(blocks)


def test_shared_prefix_blocks_are_reference_counted() -> None:
    manager = KVCacheManager(BlockPool(16), block_size=4)
    tokens = list(range(10))
    assert manager.find_cached_prefix("a", tokens) == 0
    assert manager.allocate("a", 10)
    manager.cache_full_blocks("a", tokens, 10)  # two full blocks registered
    assert manager.find_cached_prefix("b", tokens) == 8
    assert manager.block_table("b") == manager.block_table("a")[:2]
    manager.free("a")
    # b still holds the shared blocks, a's private third block is free again.
    assert manager.pool.num_free == 16 - 2
    manager.free("b")
    assert manager.pool.usage == 0.0


def test_at_least_one_token_is_left_to_compute() -> None:
    manager = KVCacheManager(BlockPool(8), block_size=4)
    tokens = list(range(8))
    manager.find_cached_prefix("a", tokens)
    manager.allocate("a", 8)
    manager.cache_full_blocks("a", tokens, 8)
    manager.free("a")
    assert manager.find_cached_prefix("b", tokens) == 4  # not 8


def test_a_prefix_is_looked_up_without_taking_its_blocks() -> None:
    """What a waiting prompt's admission would find, known before it takes a block;
    the hashes computed for it are kept and reused, and follow evictions."""
    manager = KVCacheManager(BlockPool(6), block_size=4)
    tokens = list(range(14))
    manager.find_cached_prefix("a", tokens)
    manager.allocate("a", 14)
    manager.cache_full_blocks("a", tokens, 14)  # three full blocks registered
    manager.free("a")
    hashes: list[bytes] = []
    longer = [*tokens[:12], 99, 98, 97]
    assert manager.cached_prefix_length(longer, hashes) == 12
    assert len(hashes) == 3  # computed as far as the lookup went
    assert manager.pool.num_free == 6  # nothing taken
    assert manager.find_cached_prefix("b", longer, hashes) == 12
    assert manager.pool.num_free == 3
    manager.free("b")
    # Four blocks: the two never used, the partial one, then the prefix's tail.
    assert manager.allocate("c", 16)
    assert manager.cached_prefix_length(longer, hashes) == 8


def test_freed_cached_blocks_are_evicted_oldest_first() -> None:
    manager = KVCacheManager(BlockPool(4), block_size=2)
    for name, tokens in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        manager.find_cached_prefix(name, tokens)
        manager.allocate(name, 3)
        manager.cache_full_blocks(name, tokens, 2)
        manager.free(name)
    # Two new blocks: the free list hands out a's blocks (freed first) before b's.
    manager.find_cached_prefix("c", [9, 9, 9, 9, 9])
    manager.allocate("c", 4)
    assert manager.find_cached_prefix("d", [4, 5, 6]) == 2  # b's prefix survived
    assert manager.find_cached_prefix("e", [1, 2, 3]) == 0  # a's was evicted


def test_prefix_caching_can_be_disabled() -> None:
    manager = KVCacheManager(BlockPool(8, enable_prefix_caching=False), block_size=2)
    manager.find_cached_prefix("a", [1, 2, 3])
    manager.allocate("a", 3)
    manager.cache_full_blocks("a", [1, 2, 3], 3)
    assert manager.find_cached_prefix("b", [1, 2, 3]) == 0


def test_a_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    manager = KVCacheManager(BlockPool(16), block_size=4)
    manager.allocate("parent", 10)  # two full blocks and a partial one
    parent_table = manager.block_table("parent")
    allocated = manager.pool.num_allocated_total
    placed, copies = manager.fork("parent", ["c0", "c1", "c2"], 10)
    assert placed == ["c0", "c1", "c2"]
    assert manager.block_table("parent") == []
    assert manager.block_table("c0") == parent_table
    for child in ("c1", "c2"):
        table = manager.block_table(child)
        assert table[:2] == parent_table[:2] and table[2] != parent_table[2]
    assert copies == [(parent_table[2], manager.block_table(c)[2]) for c in ("c1", "c2")]
    # Only the two copies were allocated; the prompt's blocks were not.
    assert manager.pool.num_allocated_total == allocated + 2
    for child in ("c0", "c1", "c2"):
        manager.free(child)
    assert manager.pool.usage == 0.0


def test_a_fork_at_a_block_boundary_copies_nothing() -> None:
    manager = KVCacheManager(BlockPool(8), block_size=4)
    manager.allocate("parent", 8)
    placed, copies = manager.fork("parent", ["c0", "c1"], 8)
    assert placed == ["c0", "c1"] and copies == []
    assert manager.block_table("c0") == manager.block_table("c1")
    manager.free("c0")
    assert manager.pool.num_free == 6  # c1 still holds both
    manager.free("c1")
    assert manager.pool.usage == 0.0


def test_children_without_a_block_for_their_copy_get_no_table() -> None:
    manager = KVCacheManager(BlockPool(4), block_size=4)
    manager.allocate("parent", 10)  # three blocks: one left
    placed, copies = manager.fork("parent", ["c0", "c1", "c2"], 10)
    assert placed == ["c0", "c1"] and len(copies) == 1
    assert manager.block_table("c2") == []
    manager.free("c0")
    manager.free("c1")
    assert manager.pool.usage == 0.0


def test_the_canary_catches_a_write_into_a_free_block_and_spares_cached_ones() -> None:
    torch = pytest.importorskip("torch")
    from pdserve.workers.engine.canary import KVCanary

    kv = torch.zeros((2, 6, 2, 4, 1, 2))
    canary = KVCanary(kv, 1234.5)
    manager = KVCacheManager(BlockPool(6, watcher=canary), block_size=4)
    canary.freed(range(6))

    assert manager.allocate("a", 8)  # two blocks, checked when taken: intact
    kv[:, manager.block_table("a")] = 0.25  # the request's own KV
    manager.cache_full_blocks("a", list(range(8)), 8)  # prefix-cached: kept when freed
    manager.allocate("b", 4)
    freed = manager.block_table("b")
    manager.free("b")
    manager.free("a")
    assert (kv[:, freed] == 1234.5).all()  # a free block holds the pattern
    assert (kv[:, manager.pool.lookup(hash_block(None, [0, 1, 2, 3])) or 0] == 0.25).all()
    assert canary.sweep() == 0

    kv[1, freed[0], 0, 3] = 7.0  # a late write into a free block
    assert canary.sweep() == 1
    assert canary.sweep() == 1  # reported once
