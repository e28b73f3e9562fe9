"""How long a request sent to a worker waits before its prompt is computed at all:
for a seat in the running batch, or for KV blocks.

A worker runs at most `max_num_seqs` requests at once, and a request's prompt needs
KV blocks for the tokens it does not find cached. A request that finds no seat, or
fewer free blocks than it and the prompts queued before it need, waits until
running requests end and give theirs back (or, for blocks, until the scheduler
preempts one, which costs that one a recompute). Every worker publishes at /load
what that wait depends on (`BatchRoom`): its seats, its blocks (those no request holds:
free, or cached and unused, so reusable now) and, for each running request, the steps
it has left at most (its prompt still to compute, in full steps, then the tokens its
max_tokens still allows) and the blocks it holds, soonest first. The wait is then:

    seat:   the k-th request to end, k = requests held + 1 - seats (when positive)
    blocks: the first request whose end, with those before it, frees the blocks
            missing = blocks for (queued + uncached tokens) - free blocks

in steps; the longer of the two, less the steps already run since the worker
published. A worker ends requests sooner than their max_tokens when they stop on
their own, so this is the longest wait, not the likeliest.

What a worker publishes is a peer's word: anything missing, negative, out of bounds or
inconsistent (more free blocks than blocks, more running requests than seats, blocks
held beyond the cache) leaves that worker with no published room, and no wait is
predicted for it (as before it published one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Figures beyond these are not believed.
_MAX_SEATS = 1 << 16
_MAX_BLOCKS = 1 << 32
_MAX_STEPS = 1 << 24


@dataclass(frozen=True)
class BatchRoom:
    """A worker's seats and KV blocks, and when its running requests end (its /load)."""

    max_num_seqs: int
    num_kv_blocks: int
    kv_blocks_free: int
    # (steps left at most, blocks held) of each running request, soonest first.
    finishing: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> BatchRoom | None:
        """From /load's fields; None when absent or not believable."""
        try:
            seats = _count(fields["max_num_seqs"], _MAX_SEATS)
            blocks = _count(fields["num_kv_blocks"], _MAX_BLOCKS)
            free = _count(fields["kv_blocks_free"], blocks)
            finishing = _finishing(fields["finishing"], seats, blocks)
        except (KeyError, ValueError):
            return None
        if seats < 1 or blocks < 1:
            return None
        return cls(seats, blocks, free, finishing)

    def wait_steps(self, requests: int, blocks_needed: int) -> int:
        """Steps a request waits for a seat and for `blocks_needed` blocks (those of
        its own uncached tokens and of the prompts queued before it) on a worker that
        holds `requests` requests (running or waiting) besides it."""
        return max(self._seat_wait(requests), self._block_wait(blocks_needed))

    def _seat_wait(self, requests: int) -> int:
        ends_needed = requests + 1 - self.max_num_seqs
        if ends_needed <= 0 or not self.finishing:
            return 0
        # Beyond the requests running now, each round of ends takes as long again.
        rounds, index = divmod(ends_needed - 1, len(self.finishing))
        return rounds * self.finishing[-1][0] + self.finishing[index][0]

    def _block_wait(self, blocks_needed: int) -> int:
        missing = blocks_needed - self.kv_blocks_free
        if missing <= 0:
            return 0
        freed = 0
        for steps, held in self.finishing:
            freed += held
            if freed >= missing:
                return steps
        # Not even every running request's blocks: they all end first.
        return self.finishing[-1][0] if self.finishing else 0


def _count(value: Any, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError("not a count")
    return value


def _finishing(value: Any, seats: int, blocks: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or len(value) > seats:
        raise ValueError("not a list of running requests")
    found = []
    for entry in value:
        if not isinstance(entry, list | tuple) or len(entry) != 2:
            raise ValueError("not a pair")
        found.append((_count(entry[0], _MAX_STEPS), _count(entry[1], blocks)))
    return tuple(sorted(found))
