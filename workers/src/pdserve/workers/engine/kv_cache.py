"""The paged KV cache's bookkeeping: a pool of fixed-size blocks with reference counts
and prefix hashes, and a block table per request.

The tensors themselves live in the runner; this module only decides which block
holds which tokens. A full block is identified by a hash chained to its parent's
hash, so two requests with the same prefix share the blocks of that prefix. A block
whose last user finished stays cached (and counts as free) until it is reused for
something else, least recently freed first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Protocol

BlockHash = bytes


class BlockWatcher(Protocol):
    """Told when blocks change hands (the KV canary, see canary.py)."""

    def freed(self, blocks: Iterable[int]) -> None:
        """Blocks became free holding nothing worth keeping."""

    def taken(self, blocks: Iterable[int]) -> None:
        """Free blocks were handed out again."""


class PrefixWatcher(Protocol):
    """Told what the prefix cache gains and loses (the KV event log, see kv_events.py)."""

    def stored(self, block_hash: BlockHash) -> None:
        """A full block was registered under `block_hash`."""

    def removed(self, block_hash: BlockHash) -> None:
        """The block registered under `block_hash` was evicted."""

    def cleared(self) -> None:
        """Every registered block was dropped."""

    def publish(self) -> None:
        """The changes so far are complete (a step ended): tell whoever waits for them."""


@lru_cache(maxsize=16)
def block_packer(length: int) -> Callable[..., bytes]:
    """`length` token ids as a block's hash takes them, little-endian int64s, in one
    call made once per length (an int64 `array` parses each id on its own: twice the
    work)."""
    return struct.Struct(f"<{length}q").pack


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block: its tokens, chained to the hash of the block before."""
    data = block_packer(len(token_ids))(*token_ids)
    return hashlib.blake2b((parent or b"") + data, digest_size=16).digest()


def seed_root(seed: str) -> BlockHash | None:
    """The parent of a prompt's first block: none without a seed, else a hash of the
    seed, so caches (and routers) with different seeds name no block alike."""
    if not seed:
        return None
    return hashlib.blake2b(seed.encode(), digest_size=16, person=b"pdserve-seed").digest()


class BlockPool:
    """Fixed-size blocks with reference counts, a free list in LRU order, and the
    hash -> block map of prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        watcher: BlockWatcher | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watcher = watcher
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # Blocks handed out by `allocate`, since start (shared blocks count once).
        self.num_allocated_total = 0
        self.prefix_watcher: PrefixWatcher | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached but unused blocks included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` free blocks, evicting cached ones oldest first; None if too few."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        self.num_allocated_total += count
        if self.watcher is not None:
            self.watcher.taken(blocks)
        return blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The cached block holding the tokens of `block_hash`, if any."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def acquire(self, block: int) -> None:
        """Add a user to a block (a prefix-cache hit)."""
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one user of each block. Pass a request's blocks last first, so that the
        tail of a sequence is evicted before its (more shareable) head."""
        emptied = []
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise AssertionError(f"block {block} released more often than acquired")
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hashes[block] is None:
                    emptied.append(block)
        if self.watcher is not None:
            self.watcher.freed(emptied)

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Record that `block` now holds the full block `block_hash`."""
        if not self.enable_prefix_caching or self._hashes[block] is not None:
            return
        if block_hash not in self._cached:  # the first copy wins; duplicates stay private
            self._cached[block_hash] = block
            self._hashes[block] = block_hash
            if self.prefix_watcher is not None:
                self.prefix_watcher.stored(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only when no request holds a block (False
        otherwise: a block in use must keep its hash for the requests sharing it)."""
        if len(self._free) != self.num_blocks:
            return False
        dropped = list(self._cached.values())
        for block in dropped:
            self._hashes[block] = None
        self._cached.clear()
        if self.watcher is not None:
            self.watcher.freed(dropped)
        if self.prefix_watcher is not None:
            self.prefix_watcher.cleared()
        return True

    def _evict(self, block: int) -> None:
        block_hash = self._hashes[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block] = None
            if self.prefix_watcher is not None:
                self.prefix_watcher.removed(block_hash)


class KVCacheManager:
    """Block tables of requests on top of a BlockPool."""

    def __init__(self, pool: BlockPool, block_size: int, hash_seed: str = "") -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._root = seed_root(hash_seed)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The blocks of a request, in token order."""
        return self._tables.get(request_id, [])

    def find_cached_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hashes: list[BlockHash] | None = None,
    ) -> int:
        """Attach the longest cached prefix of `token_ids` to a request that holds no
        blocks yet; return the number of tokens it covers. At least one token is always
        left to compute, since the step that computes it also samples the next one.
        `hashes`: the prompt's block hashes as far as an earlier lookup computed them
        (see `cached_prefix_length`)."""
        assert request_id not in self._tables, "prefix lookup on a request with blocks"
        known = [] if hashes is None else hashes
        num_blocks = self.cached_prefix_length(token_ids, known) // self.block_size
        table = []
        for block_hash in known[:num_blocks]:
            block = self.pool.lookup(block_hash)
            assert block is not None, "a block found a moment ago is gone"
            self.pool.acquire(block)
            table.append(block)
        self._tables[request_id] = table
        self._hashes[request_id] = known[:num_blocks]
        return num_blocks * self.block_size

    def cached_prefix_length(self, token_ids: Sequence[int], hashes: list[BlockHash]) -> int:
        """The tokens `find_cached_prefix` would find cached now, without taking a
        block. `hashes` holds the hashes of the prompt's first blocks computed so far,
        kept by the caller between lookups (a waiting prompt is looked up every step);
        it grows as far as this lookup goes."""
        size = self.block_size
        found = 0
        for index in range((len(token_ids) - 1) // size):
            if index == len(hashes):
                parent = hashes[-1] if hashes else self._root
                hashes.append(hash_block(parent, token_ids[index * size : (index + 1) * size]))
            if self.pool.lookup(hashes[index]) is None:
                break
            found += 1
        return found * size

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow a request's table to hold `num_tokens` tokens; False if blocks ran out
        (the table is then unchanged)."""
        table = self._tables.setdefault(request_id, [])
        self._hashes.setdefault(request_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        table.extend(blocks)
        return True

    def has_new_full_blocks(self, request_id: str, num_computed: int) -> bool:
        """Whether blocks became full that `cache_full_blocks` has not registered yet
        (most decode steps fill none: their caller need not gather the tokens)."""
        return num_computed // self.block_size > len(self._hashes.get(request_id, ()))

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int
    ) -> None:
        """Register the hashes of blocks that became full once `num_computed` tokens of
        `token_ids` are in the cache."""
        table, hashes = self._tables[request_id], self._hashes[request_id]
        for index in range(len(hashes), num_computed // self.block_size):
            start = index * self.block_size
            parent = hashes[-1] if hashes else self._root
            block_hash = hash_block(parent, token_ids[start : start + self.block_size])
            hashes.append(block_hash)
            self.pool.register(table[index], block_hash)

    def fork(
        self, parent_id: str, child_ids: Sequence[str], num_tokens: int
    ) -> tuple[list[str], list[tuple[int, int]]]:
        """Hand the blocks holding a request's first `num_tokens` tokens to its
        children: the first takes the request's table, each other one shares its full
        blocks (one more reference each) and gets a block of its own for the partial
        last one, which all of them will write into. Returns the children that got a
        table (fewer than asked when blocks ran out: the others hold none) and the
        (source, destination) copies of the partial block to make before any child
        writes."""
        assert child_ids, "a fork needs a child to take the blocks"
        table = self._tables.pop(parent_id)
        hashes = self._hashes.pop(parent_id)
        first, *others = child_ids
        self._tables[first], self._hashes[first] = table, hashes
        num_full = num_tokens // self.block_size
        shared, partial = table[:num_full], table[num_full : self.blocks_for(num_tokens)]
        placed, copies = [first], list[tuple[int, int]]()
        for child in others:
            own = self.pool.allocate(len(partial))
            if own is None:
                break
            for block in shared:
                self.pool.acquire(block)
            self._tables[child] = shared + own
            self._hashes[child] = list(hashes)
            copies.extend(zip(partial, own, strict=True))
            placed.append(child)
        return placed, copies

    def free(self, request_id: str) -> None:
        """Release every block of a request (finished, aborted or preempted)."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self.pool.release(table[::-1])
