"""A prompt's block keys in the router's KV index, as the workers name their blocks:
the engine's chained block hashes (`engine.kv_events.prefix_hashes`, the hash the
KV event feeds carry) made keys (`kv_index.block_key`), computed for every request.
The same hashes, for less work per block: a block's ids become bytes in one call of
a packer made once per block size (an `array` of int64s converts each id through
an argument parser, about twice the cost), a seed's root is hashed once per seed,
and no list of hashes is kept, only the keys."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from functools import lru_cache

from pdserve.workers.engine.kv_cache import seed_root
from pdserve.workers.router.kv_index import BlockKey


@lru_cache(maxsize=16)
def _root(seed: str) -> bytes:
    """The parent of a prompt's first block (empty without a seed)."""
    return seed_root(seed) or b""


@lru_cache(maxsize=16)
def _packer(block_size: int) -> Callable[..., bytes]:
    """One block's ids as the engine hashes them: little-endian int64s."""
    return struct.Struct(f"<{block_size}q").pack


def prompt_block_keys(
    token_ids: Sequence[int], block_size: int, seed: str = ""
) -> tuple[BlockKey, ...]:
    """The index keys of every full block of `token_ids`, chained from `seed`'s root."""
    blocks = len(token_ids) // block_size
    if blocks == 0:
        return ()
    pack = _packer(block_size)
    blake2b = hashlib.blake2b
    parent = _root(seed)
    keys = []
    for start in range(0, blocks * block_size, block_size):
        digest = blake2b(parent, digest_size=16)
        digest.update(pack(*token_ids[start : start + block_size]))
        parent = digest.digest()
        keys.append(int.from_bytes(parent[:8], "little"))
    return tuple(keys)
