"""The router's exact index of which worker of a role holds which KV block.

Each worker's prefix cache is mirrored from its event feed (`kv_subscriber`): a block
is a key (the first 8 bytes of its chained hash, an int: half the memory of the
hash's bytes, and a false match, one in 2^64, can only misplace a request, never
change an answer) mapped to a bit mask of the worker slots holding it. A prompt's
hashes are chained, so a worker holds a prompt's first k blocks exactly when it
holds block k's hash: the cached prefix of every worker comes from one walk along
the prompt's hashes, AND-ing masks.

Memory is bounded: a worker holds at most as many entries as its cache has blocks
(its handshake says how many; one past that and its feed is resynchronised), and
the index as a whole at most `max_entries`. `memory_bytes` estimates what it holds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockKey = int

DEFAULT_MAX_ENTRIES = 8_000_000


def block_key(block_hash: bytes) -> BlockKey:
    """The index key of a block hash."""
    return int.from_bytes(block_hash[:8], "little")


class IndexFullError(Exception):
    """A worker's blocks would take the index past a bound."""


@dataclass
class _Slot:
    """One worker's place in the index."""

    bit: int
    capacity: int  # the most blocks the worker's cache holds
    blocks: int = 0


class KVIndex:
    """Which worker holds which block, for the workers of one role."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._masks: dict[BlockKey, int] = {}
        self._slots: dict[str, _Slot] = {}

    def __len__(self) -> int:
        """Distinct blocks held by any worker."""
        return len(self._masks)

    @property
    def workers(self) -> list[str]:
        """The workers indexed."""
        return sorted(self._slots)

    def blocks(self, worker: str) -> int:
        """Blocks indexed for `worker`."""
        slot = self._slots.get(worker)
        return 0 if slot is None else slot.blocks

    @property
    def entries(self) -> int:
        """(block, worker) pairs held: blocks x workers, shared blocks once each."""
        return sum(slot.blocks for slot in self._slots.values())

    def memory_bytes(self) -> int:
        """The index's own memory: its table, and its keys (64-bit ints; masks of up to
        8 workers are ints Python shares, wider ones are counted at their size)."""
        keys = len(self._masks) * sys.getsizeof(1 << 63)
        wide = sum(sys.getsizeof(mask) for mask in self._masks.values() if mask > 256)
        return sys.getsizeof(self._masks) + keys + wide

    # -- a worker's blocks -------------------------------------------------------

    def replace(self, worker: str, keys: Iterable[BlockKey], capacity: int) -> None:
        """Set `worker`'s blocks to `keys` (a snapshot). IndexFullError, with the worker
        left out of the index, when they exceed its capacity or the index's bound."""
        self.drop(worker)
        self._slots[worker] = _Slot(self._free_bit(), capacity)
        self.store(worker, keys)

    def store(self, worker: str, keys: Iterable[BlockKey]) -> None:
        """`worker` registered these blocks. IndexFullError past a bound (the worker's
        blocks are then dropped, to be read again from a snapshot)."""
        slot = self._slots.get(worker)
        if slot is None:
            return
        try:
            for key in keys:
                self._add(slot, key)
        except IndexFullError:
            self.drop(worker)
            raise

    def remove(self, worker: str, keys: Iterable[BlockKey]) -> None:
        """`worker` evicted these blocks."""
        slot = self._slots.get(worker)
        if slot is None:
            return
        for key in keys:
            mask = self._masks.get(key, 0)
            if mask & slot.bit:
                slot.blocks -= 1
                if mask == slot.bit:
                    del self._masks[key]
                else:
                    self._masks[key] = mask & ~slot.bit

    def apply(self, worker: str, kind: str, keys: Sequence[BlockKey]) -> None:
        """One event of `worker`'s feed: `keys` stored or removed, or all cleared.
        IndexFullError as `store`."""
        if kind == "stored":
            self.store(worker, keys)
        elif kind == "removed":
            self.remove(worker, keys)
        else:
            self.clear(worker)

    def clear(self, worker: str) -> None:
        """`worker` dropped every block (it stays indexed, holding none)."""
        slot = self._slots.get(worker)
        if slot is not None:
            self._strip(slot.bit)
            slot.blocks = 0

    def drop(self, worker: str) -> None:
        """Forget `worker` (gone, refused, or about to be read again)."""
        slot = self._slots.pop(worker, None)
        if slot is not None:
            self._strip(slot.bit)

    def _add(self, slot: _Slot, key: BlockKey) -> None:
        mask = self._masks.get(key, 0)
        if mask & slot.bit:
            return
        if slot.blocks >= slot.capacity:
            raise IndexFullError(f"more blocks than the worker's cache holds ({slot.capacity})")
        if not mask and len(self._masks) >= self.max_entries:
            raise IndexFullError(f"the index holds its most blocks ({self.max_entries})")
        self._masks[key] = mask | slot.bit
        slot.blocks += 1

    def _strip(self, bit: int) -> None:
        for key, mask in list(self._masks.items()):
            if mask & bit:
                if mask == bit:
                    del self._masks[key]
                else:
                    self._masks[key] = mask & ~bit

    def _free_bit(self) -> int:
        taken = 0
        for slot in self._slots.values():
            taken |= slot.bit
        bit = 1
        while taken & bit:
            bit <<= 1
        return bit

    # -- scoring --------------------------------------------------------------------

    def cached_blocks(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """For each indexed worker, how many of a prompt's first blocks it holds
        (`keys`: the prompt's block keys, in order)."""
        held = {worker: 0 for worker in self._slots}
        alive = 0
        for slot in self._slots.values():
            alive |= slot.bit
        for position, key in enumerate(keys):
            matched = self._masks.get(key, 0) & alive
            if matched != alive:
                self._settle(held, alive & ~matched, position)
            alive = matched
            if not alive:
                return held
        self._settle(held, alive, len(keys))
        return held

    def _settle(self, held: dict[str, int], bits: int, blocks: int) -> None:
        for worker, slot in self._slots.items():
            if bits & slot.bit:
                held[worker] = blocks
