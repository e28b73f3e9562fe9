"""The router's block keys of a prompt are the keys of the hashes the engine gives
its blocks (and publishes in its KV events)."""

from __future__ import annotations

import random

import pytest

from pdserve.workers.engine.kv_cache import hash_block, seed_root
from pdserve.workers.engine.kv_events import prefix_hashes
from pdserve.workers.router import kv_keys
from pdserve.workers.router.kv_index import block_key
from pdserve.workers.router.kv_keys import prompt_block_keys


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("seed", ["", "pool-seed", "种子 🌱"])
def test_keys_are_the_engines_hashes(block_size: int, seed: str) -> None:
    draw = random.Random(f"{block_size}{seed}")
    for length in [0, 1, block_size - 1, block_size, block_size + 1, 5 * block_size - 1,
                   5 * block_size, 5 * block_size + 1, 40 * block_size + 7]:  # fmt: skip
        tokens = [draw.randrange(0, 2**31) for _ in range(length)]
        expected = tuple(block_key(h) for h in prefix_hashes(tokens, block_size, seed))
        assert prompt_block_keys(tokens, block_size, seed) == expected
        assert prompt_block_keys(tuple(tokens), block_size, seed) == expected


def test_the_chain_starts_at_the_seeds_root() -> None:
    tokens = list(range(8))
    first = hash_block(seed_root("s"), tokens[:4])
    second = hash_block(first, tokens[4:])
    assert prompt_block_keys(tokens, 4, "s") == (block_key(first), block_key(second))
    assert prompt_block_keys(tokens, 4, "s") != prompt_block_keys(tokens, 4, "")
    # A prompt that differs in one token differs from that block on, not before.
    changed = prompt_block_keys([*tokens[:5], 99, *tokens[6:]], 4, "s")
    assert changed[0] == block_key(first) and changed[1] != block_key(second)


def test_blocks_seen_before_are_found_and_new_ones_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    draw = random.Random(7)
    shared = [draw.randrange(0, 2**31) for _ in range(64)]
    prompts = [shared + [draw.randrange(0, 2**31) for _ in range(40)] for _ in range(3)]
    prompts.append(prompts[0][:70] + prompts[1][70:])  # the first's blocks, then another's
    prompts.append([*shared[:16], 5, *shared[17:]])  # one token changed in its second block
    for limit in (1 << 15, 3, 1):  # kept forgotten when full: whenever, the same keys
        monkeypatch.setattr(kv_keys, "MAX_KNOWN_BLOCKS", limit)
        kv_keys._known.clear()
        for _ in range(2):  # not seen, then seen
            for tokens in prompts:
                for seed in ("", "s"):
                    expected = tuple(block_key(h) for h in prefix_hashes(tokens, 16, seed))
                    assert prompt_block_keys(tokens, 16, seed) == expected
        assert len(kv_keys._known) <= limit
