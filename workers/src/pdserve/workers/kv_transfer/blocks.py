"""Block lists as both ends of a transfer see them: checked against a cache, and cut
into runs of consecutive ids (one contiguous range per layer each)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """`count` consecutive block ids from `start`, at `position` in the block list."""

    start: int
    count: int
    position: int


def runs(blocks: Sequence[int]) -> list[Run]:
    """The list cut wherever the next id is not the previous one plus one."""
    found: list[Run] = []
    for position, block in enumerate(blocks):
        last = found[-1] if found else None
        if last is not None and block == last.start + last.count:
            found[-1] = Run(last.start, last.count + 1, last.position)
        else:
            found.append(Run(block, 1, position))
    return found


def check_blocks(blocks: Sequence[int], num_blocks: int, side: str) -> None:
    """ValueError when an id lies outside a cache of `num_blocks` blocks (a wrong id
    would copy over another request's KV)."""
    bad = [block for block in blocks if not 0 <= block < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} outside the cache's {num_blocks} blocks")
