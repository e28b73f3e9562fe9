"""A test instrument: catch any write into a KV block while the block is free.

Off unless the environment variable PDSERVE_KV_CANARY is set (to a number, the
pattern). Every free block that holds nothing worth keeping (no prefix-cache entry)
is filled with the pattern; when the block is handed out again, and on `sweep`, the
pattern must still be there. A block that changed while free was written by someone
who no longer owned it (a transfer that landed after its blocks were freed): that is
logged as an error with the block's id and counted. Costs a fill per freed block and
a comparison per allocated one, so it is for tests only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

ENV = "PDSERVE_KV_CANARY"
MESSAGE = "KV canary: block %d changed while it was free"


def pattern_from_environment() -> float | None:
    """The pattern PDSERVE_KV_CANARY asks for; None when the canary is off."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number (the fill pattern), got {raw!r}") from None


class KVCanary:
    """Fills free blocks of a cache [layers, blocks, ...] with a pattern and checks it."""

    def __init__(self, kv_cache: torch.Tensor, pattern: float) -> None:
        self.kv_cache = kv_cache
        self.pattern = pattern
        self.violations = 0
        self._filled: set[int] = set()

    def freed(self, blocks: Iterable[int]) -> None:
        """Blocks became free with nothing worth keeping: fill them."""
        ids = sorted(set(blocks))
        if ids:
            self.kv_cache[:, ids] = self.pattern
            self._filled.update(ids)

    def taken(self, blocks: Iterable[int]) -> None:
        """Free blocks are handed out again: they must still hold the pattern."""
        ids = [block for block in blocks if block in self._filled]
        self._check(ids)
        self._filled.difference_update(ids)

    def sweep(self) -> int:
        """Check every filled free block; the number of violations so far."""
        self._check(sorted(self._filled))
        return self.violations

    def _check(self, ids: list[int]) -> None:
        if not ids:
            return
        intact = (self.kv_cache[:, ids] == self.pattern).flatten(2).all(dim=2).all(dim=0)
        for block, ok in zip(ids, intact.tolist(), strict=True):
            if not ok:
                self.violations += 1
                log.error(MESSAGE, block)
                self.kv_cache[:, block] = self.pattern  # report each write once
