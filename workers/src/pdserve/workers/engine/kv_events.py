"""What a worker's prefix cache gains and loses, as a numbered stream of events with a
snapshot, for routers that keep an index of which worker holds which block.

The block pool reports each full block it registers under its chained hash
(`stored`), each such block it evicts (`removed`) and a reset that drops them all
(`cleared`). The log numbers the events from 1 within an epoch, a random name drawn
when the log is made (so a restarted worker starts a new epoch), keeps the last
`capacity` of them for subscribers that fell behind, and mirrors the hashes held so a
snapshot is one copy under the lock. A subscriber whose next event is no longer
kept, or whose epoch is not the log's, reads a snapshot and goes on from its sequence
number.

The pool calls in from the engine's thread; readers call from any other: everything
is under one lock. `on_change` (set by the server) is told at `publish`, which the
engine's loop calls once per step (and after the commands it runs between steps), and
only when events came: a waiting reader is woken once with the whole step's events.
Telling it at each change woke the server's thread at every block a prompt chunk
stored, and each wake-up (a write to the loop's self-pipe, which hands the interpreter
lock over) made the server answer one block and the router ask again, while the
engine was still in its step: a few round trips per prompt chunk, on the step's time.
The module imports nothing that loads torch: the router computes the same hashes.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pdserve.workers.engine.kv_cache import BlockHash, hash_block, seed_root

# The hash a block is known by: blake2b with a 16-byte digest over the parent block's
# hash and the block's token ids as little-endian int64s; the first block's parent is
# empty, or a hash of the pool's seed. A router must compute exactly this, with the
# same block size and seed, to match.
HASH_FUNCTION = "blake2b-128-chained-int64"
# How a handshake names the absence of a seed (every process hashes alike then).
HASH_SEED = ""
DEFAULT_CAPACITY = 8192  # events kept for subscribers that fell behind
MAX_FOLD = 64  # hashes one event may carry

EventKind = Literal["stored", "removed", "cleared"]


def seed_fingerprint(seed: str) -> str:
    """What a handshake says of a hash seed: a digest that tells seeds apart without
    giving the seed (the one of no seed is HASH_SEED)."""
    if not seed:
        return HASH_SEED
    return hashlib.blake2b(seed.encode(), digest_size=8, person=b"pdserve-seed-id").hexdigest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, seed: str = "") -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids`, as an engine with the
    hash seed `seed` names them."""
    hashes: list[BlockHash] = []
    parent = seed_root(seed)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class KVEvent:
    """One change of the prefix cache: `hashes` stored or removed, or all cleared."""

    seq: int
    kind: EventKind
    hashes: tuple[BlockHash, ...] = ()


@dataclass(frozen=True)
class KVSnapshot:
    """Every hash the cache holds, as of event `seq` of `epoch`."""

    epoch: str
    seq: int
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class KVEventsSince:
    """The events after a sequence number, or `gap` when they are no longer all kept
    (or the epoch is another): then read a snapshot."""

    epoch: str
    seq: int  # the last event's number now
    events: tuple[KVEvent, ...] = ()
    gap: bool = False


class KVEventLog:
    """The prefix cache's events with a bounded replay buffer (a `PrefixWatcher`)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, epoch: str | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"the KV event buffer needs room for an event, got {capacity}")
        self.epoch = epoch or uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._held: dict[BlockHash, None] = {}
        self._seq = 0
        self._published = 0  # the last event number `on_change` was told of
        self.on_change: Callable[[], None] = lambda: None

    @property
    def seq(self) -> int:
        """The number of the last event (0: none yet)."""
        return self._seq

    def __len__(self) -> int:
        return len(self._held)

    def stored(self, block_hash: BlockHash) -> None:
        """A full block was registered in the prefix cache."""
        with self._lock:
            self._held[block_hash] = None
            self._append("stored", block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        """A cached block was evicted."""
        with self._lock:
            self._held.pop(block_hash, None)
            self._append("removed", block_hash)

    def cleared(self) -> None:
        """The prefix cache dropped every block."""
        with self._lock:
            self._held.clear()
            self._seq += 1
            self._events.append(KVEvent(self._seq, "cleared"))

    def publish(self) -> None:
        """Tell `on_change` that events came since the last call, if any did (from the
        engine's thread, at the end of a step)."""
        if self._seq != self._published:
            self._published = self._seq
            self.on_change()

    def _append(self, kind: EventKind, block_hash: BlockHash) -> None:
        # Runs of one kind fold into one event: a prompt's blocks are stored together,
        # an allocation evicts several at once.
        # An event of n hashes stands for sequence numbers seq - n + 1 .. seq.
        last = self._events[-1] if self._events else None
        self._seq += 1
        if last is not None and last.kind == kind and len(last.hashes) < MAX_FOLD:
            self._events[-1] = KVEvent(self._seq, kind, (*last.hashes, block_hash))
            return
        self._events.append(KVEvent(self._seq, kind, (block_hash,)))

    def snapshot(self) -> KVSnapshot:
        """Every hash held now, and the sequence number it includes."""
        with self._lock:
            return KVSnapshot(self.epoch, self._seq, tuple(self._held))

    def since(self, epoch: str, seq: int) -> KVEventsSince:
        """The events after `seq` of `epoch` (an event that folds several hashes is
        given whole when it covers any number after `seq`)."""
        with self._lock:
            if epoch != self.epoch or seq > self._seq or seq < 0:
                return KVEventsSince(self.epoch, self._seq, gap=True)
            if seq == self._seq:
                return KVEventsSince(self.epoch, self._seq)
            first = self._events[0] if self._events else None
            if first is None or _first_number(first) > seq + 1:
                return KVEventsSince(self.epoch, self._seq, gap=True)
            events = tuple(event for event in self._events if event.seq > seq)
            if events and _first_number(events[0]) <= seq:
                # The subscriber saw part of a folded event: give the part it lacks.
                head = events[0]
                events = (
                    KVEvent(head.seq, head.kind, head.hashes[seq - head.seq :]),
                    *events[1:],
                )
            return KVEventsSince(self.epoch, self._seq, events)


def _first_number(event: KVEvent) -> int:
    """The first sequence number an event stands for."""
    return event.seq - max(1, len(event.hashes)) + 1
