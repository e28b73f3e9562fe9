"""KV blocks held outside the scheduler for a P/D hand-off, each under a lease.

On a decode worker, blocks reserved for a prompt that a prefill worker is computing
and writing; on a prefill worker, the blocks of a finished prompt waiting to be sent.
A lease has two ends:

- its deadline: past it the blocks can no longer be adopted (the hand-off failed);
- its hold: until then the blocks stay allocated, deadline or not, unless released
  first. A peer's write into reserved blocks may still land after the deadline, so
  the decode worker releases them only once the write has provably stopped (the
  prefill worker answered, or acknowledged a cancel); the hold, a margin after the
  deadline, is the backstop for a peer that never says so. Freed blocks never
  receive a late write, and a peer that dies never leaks them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.workers.engine.clock import Clock
from pdserve.workers.engine.kv_cache import KVCacheManager
from pdserve.workers.engine.request import Request


class LeaseError(LookupError):
    """A hand-off that names a lease this worker does not hold (unknown or expired)."""


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode worker reserved for a prompt."""

    request_id: str
    block_ids: list[int]  # blocks the prefill worker must fill, in prompt order
    first_block: int  # index of block_ids[0] among the prompt's blocks
    num_cached_tokens: int  # prompt tokens already here (prefix cache): not sent
    deadline: float  # adoptable until then (time.monotonic())
    hold_until: float  # the blocks are freed then at the latest


@dataclass
class _Lease:
    request: Request
    deadline: float
    hold_until: float
    expired: bool = False  # the deadline passed (counted once)


class LeaseBook:
    """Requests whose blocks are held under a lease."""

    def __init__(self, kv_cache: KVCacheManager, clock: Clock = time.monotonic) -> None:
        self.kv_cache = kv_cache
        self.clock = clock
        self._held: dict[str, _Lease] = {}
        self.num_expired = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request: Request, lease_s: float, margin_s: float = 0.0) -> _Lease:
        """Put a request's blocks under a lease of `lease_s` seconds from now, kept
        `margin_s` longer unless released."""
        deadline = self.clock() + lease_s
        lease = _Lease(request, deadline, deadline + margin_s)
        self._held[request.request_id] = lease
        return lease

    def take(self, request_id: str) -> Request:
        """Remove a live lease (the blocks stay allocated); LeaseError if it is unknown
        or past its deadline (then it stays, until released or held out)."""
        lease = self._held.get(request_id)
        if lease is None or lease.expired or lease.deadline < self.clock():
            raise LeaseError(f"no lease for request {request_id!r} (unknown or expired)")
        del self._held[request_id]
        return lease.request

    def release(self, request_id: str) -> Request | None:
        """End a lease and free its blocks now; None if there was none."""
        lease = self._held.pop(request_id, None)
        if lease is None:
            return None
        self.kv_cache.free(request_id)
        return lease.request

    def expire(self, now: float | None = None) -> list[Request]:
        """Mark leases past their deadline (they can no longer be taken) and free the
        blocks of those past their hold; the requests whose blocks were freed."""
        now = self.clock() if now is None else now
        for lease in self._held.values():
            if not lease.expired and lease.deadline < now:
                lease.expired = True
                self.num_expired += 1
        over = [lease.request for lease in self._held.values() if lease.hold_until < now]
        for request in over:
            self.release(request.request_id)
        return over

    def next_deadline(self) -> float | None:
        """When `expire` next has something to do."""
        times = [
            lease.hold_until if lease.expired else lease.deadline for lease in self._held.values()
        ]
        return min(times, default=None)
