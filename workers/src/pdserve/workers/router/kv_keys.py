"""A prompt's block keys in the router's KV index, as the workers name their blocks:
the engine's chained block hashes (`engine.kv_events.prefix_hashes`, the hash the
KV event feeds carry) made keys (`kv_index.block_key`), computed for every request.
The same hashes, for less work per block: the prompt becomes bytes once (not a
block at a time), a seed's root is hashed once per seed, and no list of hashes is
kept, only the keys."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import lru_cache

from pdserve.workers.engine.kv_cache import seed_root
from pdserve.workers.router.kv_index import BlockKey

_TOKEN_BYTES = 8  # the engine hashes token ids as little-endian int64s ("q")


@lru_cache(maxsize=16)
def _root(seed: str) -> bytes:
    """The parent of a prompt's first block (empty without a seed)."""
    return seed_root(seed) or b""


def prompt_block_keys(
    token_ids: Sequence[int], block_size: int, seed: str = ""
) -> tuple[BlockKey, ...]:
    """The index keys of every full block of `token_ids`, chained from `seed`'s root."""
    blocks = len(token_ids) // block_size
    if blocks == 0:
        return ()
    step = block_size * _TOKEN_BYTES
    data = memoryview(array("q", token_ids[: blocks * block_size]).tobytes())
    blake2b = hashlib.blake2b
    parent = _root(seed)
    keys = []
    for start in range(0, blocks * step, step):
        digest = blake2b(parent, digest_size=16)
        digest.update(data[start : start + step])
        parent = digest.digest()
        keys.append(int.from_bytes(parent[:8], "little"))
    return tuple(keys)
