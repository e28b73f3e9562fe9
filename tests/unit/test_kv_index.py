"""The router's KV index: the cached prefix of each worker, its bounds, and the
handshake's checks."""

from __future__ import annotations

import pytest

from pdserve.workers.engine.kv_events import HASH_FUNCTION, HASH_SEED, prefix_hashes
from pdserve.workers.kv_wire import KVIdentity
from pdserve.workers.router.kv_index import IndexFullError, KVIndex, block_key
from pdserve.workers.router.kv_subscriber import Expected, PoolWeights, RefusedError


def keys(tokens: list[int], block: int = 4) -> list[int]:
    return [block_key(h) for h in prefix_hashes(tokens, block)]


def test_each_worker_gets_the_length_of_the_prefix_it_holds() -> None:
    index = KVIndex()
    prompt = keys(list(range(40)))  # 10 blocks
    index.replace("a", prompt[:3], capacity=100)
    index.replace("b", prompt[:7], capacity=100)
    index.replace("c", [], capacity=100)
    assert index.cached_blocks(prompt) == {"a": 3, "b": 7, "c": 0}
    index.remove("b", [prompt[2]])  # a hole: only the blocks before it count
    assert index.cached_blocks(prompt)["b"] == 2
    index.store("c", prompt)
    assert index.cached_blocks(prompt)["c"] == 10


def test_a_dropped_or_cleared_worker_holds_nothing() -> None:
    index = KVIndex()
    prompt = keys(list(range(16)))
    index.replace("a", prompt, capacity=10)
    index.replace("b", prompt, capacity=10)
    index.clear("a")
    assert index.cached_blocks(prompt) == {"a": 0, "b": 4}
    index.drop("b")
    assert index.cached_blocks(prompt) == {"a": 0}
    assert len(index) == 0 and index.entries == 0


def test_a_worker_claiming_more_blocks_than_its_cache_is_dropped() -> None:
    index = KVIndex()
    with pytest.raises(IndexFullError):
        index.replace("a", keys(list(range(40))), capacity=5)
    assert index.workers == []
    index.replace("b", keys(list(range(16))), capacity=4)
    with pytest.raises(IndexFullError):
        index.store("b", keys(list(range(100, 120))))
    assert index.workers == []


def test_the_index_as_a_whole_is_bounded() -> None:
    index = KVIndex(max_entries=6)
    index.replace("a", keys(list(range(16))), capacity=100)
    index.replace("b", keys(list(range(16))), capacity=100)  # shared: no new entries
    assert len(index) == 4 and index.entries == 8
    with pytest.raises(IndexFullError):
        index.replace("c", keys(list(range(500, 540))), capacity=100)


def identity(**changes: object) -> KVIdentity:
    fields: dict[str, object] = {
        "block_size": 16, "hash_function": HASH_FUNCTION, "hash_seed": HASH_SEED,
        "model": "small", "weights": "w1", "num_blocks": 64,
    }  # fmt: skip
    return KVIdentity.model_validate({**fields, **changes})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"block_size": 32}, "block_size"),
        ({"hash_function": "sha256"}, "hash_function"),
        ({"hash_seed": "42"}, "hash_seed"),
        ({"model": "other"}, "model"),
    ],
)
def test_the_handshake_names_what_differs(change: dict[str, object], reason: str) -> None:
    expected = Expected(block_size=16, model="small")
    expected.check(identity())
    with pytest.raises(RefusedError) as refused:
        expected.check(identity(**change))
    assert refused.value.reason == reason


def test_the_pools_weights_are_those_most_workers_hold() -> None:
    weights = PoolWeights()
    weights.admit("a", "w1")
    weights.admit("b", "w1")
    with pytest.raises(RefusedError):
        weights.admit("c", "w2")
    weights.forget("a")
    weights.forget("b")
    weights.admit("c", "w2")  # the old weights are gone: the pool moved over
    assert weights.reference() == "w2"
