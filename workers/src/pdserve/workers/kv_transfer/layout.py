"""The KV cache layout both ends of a transfer must share, and how a list of blocks
becomes a few large contiguous copies.

The cache is indexed [num_layers, num_blocks, 2, block_size, kv_heads, head_dim]
(see engine/attention.py), in one of two memory orders. Block-major (the engine's:
the blocks outermost) keeps every layer of a block together, so a run of consecutive
block ids is one contiguous range of memory; layer-major has one such range per
layer. A transfer pairs the sender's blocks with the receiver's, position by
position; wherever both sides' ids run consecutively, the pairs merge into one
segment, and each segment moves as one copy (block-major) or one per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

LAYER_MAJOR = "layer_major"
BLOCK_MAJOR = "block_major"


class LayoutMismatchError(ValueError):
    """Two workers whose KV caches cannot exchange blocks."""


@dataclass(frozen=True)
class KVLayout:
    """Shape and type of a worker's KV cache, as exchanged between workers."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the prefix, e.g. "float32"
    model: str  # the served model name; prefill and decode must agree
    # A digest of the weights (see workers/model/identity.py): KV computed by other weights,
    # say during a rolling update, must not be adopted however alike the shapes.
    weights: str
    # Memory order: LAYER_MAJOR or BLOCK_MAJOR; a peer that names none is layer-major.
    order: str = LAYER_MAJOR

    @classmethod
    def of(cls, kv_cache: torch.Tensor, model: str, weights: str) -> KVLayout:
        """The layout of a cache tensor (ValueError unless it is dense in one of the
        two orders)."""
        num_layers, num_blocks, two, block_size, kv_heads, head_dim = kv_cache.shape
        assert two == 2, "the cache holds K and V side by side"
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(
            num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, model, weights,
            memory_order(kv_cache),
        )  # fmt: skip

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer (its K and V); read on every transfer, and
        asking torch for the item size costs microseconds: computed once."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).itemsize
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def block_stride(self) -> int:
        """Bytes from one block of a layer to the next block of that layer."""
        return self.block_bytes * (self.num_layers if self.order == BLOCK_MAJOR else 1)

    @property
    def layer_stride(self) -> int:
        """Bytes from a block of one layer to the same block of the next layer."""
        return self.block_bytes * (1 if self.order == BLOCK_MAJOR else self.num_blocks)

    def offset(self, layer: int, block: int) -> int:
        """Byte offset of `block` of `layer` from the start of the cache."""
        return layer * self.layer_stride + block * self.block_stride

    def check_compatible(self, peer: KVLayout, *, local: str, remote: str) -> None:
        """Raise LayoutMismatchError naming each setting where the two differ, with
        both values (the block count may differ: each side has its own cache)."""
        fields = (
            "model", "weights", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype",
            "order",
        )  # fmt: skip
        problems = [
            f"{name}: {local} has {getattr(self, name)}, {remote} has {getattr(peer, name)}"
            for name in fields
            if getattr(self, name) != getattr(peer, name)
        ]
        if problems:
            raise LayoutMismatchError("KV cache layouts differ: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        """For the workers' HTTP API."""
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> KVLayout:
        """Parse what `to_json` wrote, as a peer sent it: ValueError unless every field
        is there with a value of its kind (counts positive, a known dtype)."""
        if not isinstance(raw, dict):
            raise ValueError(f"malformed KV layout: not an object but {type(raw).__name__}")
        missing = [name for name in _REQUIRED if name not in raw]
        if missing:
            raise ValueError(f"malformed KV layout: missing {missing}")
        values = {name: raw.get(name, LAYER_MAJOR) for name in cls.__dataclass_fields__}
        bad = [
            name
            for name, value in values.items()
            if not (
                _is_count(value)
                if name in _COUNTS
                else isinstance(value, str) and 0 < len(value) <= _MAX_TEXT
            )
        ]
        if values["dtype"] not in _DTYPES:
            bad.append("dtype")
        if values["order"] not in _ORDERS:
            bad.append("order")
        if bad:
            raise ValueError(f"malformed KV layout: bad {sorted(set(bad))}")
        return cls(**values)


_COUNTS = frozenset({"num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"})
_DTYPES = frozenset({"float32", "float16", "bfloat16"})
_ORDERS = frozenset({LAYER_MAJOR, BLOCK_MAJOR})
_REQUIRED = tuple(name for name in KVLayout.__dataclass_fields__ if name != "order")
_MAX_TEXT = 256


def memory_order(kv_cache: torch.Tensor) -> str:
    """LAYER_MAJOR or BLOCK_MAJOR: how a [layers, blocks, ...] cache lies in memory
    (ValueError when it is neither: it must be registered as one dense region)."""
    if kv_cache.is_contiguous():
        return LAYER_MAJOR
    if kv_cache.transpose(0, 1).is_contiguous():
        return BLOCK_MAJOR
    raise ValueError("the KV cache must be dense, its blocks or its layers outermost")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**40


@dataclass(frozen=True)
class Segment:
    """`count` consecutive blocks from `src` on the sender to `dst` on the receiver."""

    src: int
    dst: int
    count: int


def segments(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[Segment]:
    """Pair blocks position by position and merge runs that are consecutive on both
    sides."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(
            f"block counts differ: {len(src_blocks)} to send, {len(dst_blocks)} to receive"
        )
    merged: list[Segment] = []
    if not src_blocks:
        return merged
    # One Segment per run, not per block: this runs on every transfer, over
    # thousands of blocks for a long prompt.
    start_src, start_dst, count = src_blocks[0], dst_blocks[0], 1
    for src, dst in zip(src_blocks[1:], dst_blocks[1:], strict=True):
        if src == start_src + count and dst == start_dst + count:
            count += 1
        else:
            merged.append(Segment(start_src, start_dst, count))
            start_src, start_dst, count = src, dst, 1
    merged.append(Segment(start_src, start_dst, count))
    return merged
