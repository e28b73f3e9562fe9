"""A prompt's block keys in the router's KV index, as the workers name their blocks:
the engine's chained block hashes (`engine.kv_events.prefix_hashes`, the hash the
KV event feeds carry) made keys (`kv_index.block_key`), computed for every request.

The same hashes, for less work per block: a block's ids become bytes by the engine's
own packer, a seed's root is hashed once per seed.
A block's hash is a function of its parent's hash and its ids alone, and prompts
share their first blocks (a system prompt, a conversation's earlier turns: what
KV-aware routing is for), so the hashes of the blocks seen last are kept, by those
bytes: a prompt's blocks are looked up until the first one not seen, and hashed from
there. A 9,100-token prompt: 2.9M instructions seen before, 7.1M never seen, against
7.8M hashing every block of an int64 array."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

from pdserve.workers.engine.kv_cache import block_packer, seed_root
from pdserve.workers.router.kv_index import BlockKey

# Blocks whose hashes are kept (about 350 bytes each), forgotten all at once when full.
MAX_KNOWN_BLOCKS = 1 << 15
# A block's parent hash and ids as bytes (what its hash is of): its hash, and its key.
_known: dict[bytes, tuple[bytes, BlockKey]] = {}


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
    pack = block_packer(block_size)
    blake2b = hashlib.blake2b
    known = _known
    parent = _root(seed)
    keys = []
    seen = True  # every block so far (after one not seen, the rest have new parents)
    for start in range(0, blocks * block_size, block_size):
        data = parent + pack(*token_ids[start : start + block_size])
        if seen:
            found = known.get(data)
            if found is not None:
                parent, key = found
                keys.append(key)
                continue
            seen = False
        # The engine's hash (its parent's hash, then its ids), in one update.
        parent = blake2b(data, digest_size=16).digest()
        key = int.from_bytes(parent[:8], "little")
        if len(known) >= MAX_KNOWN_BLOCKS:
            known.clear()
        known[data] = (parent, key)
        keys.append(key)
    return tuple(keys)
