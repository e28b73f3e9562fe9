"""KV blocks held outside the scheduler for a P/D hand-off, each under a lease.

On a decode worker, blocks reserved for a prompt that a prefill worker is computing;
on a prefill worker, the blocks of a finished prompt waiting to be sent. Either way
the blocks are freed when the hand-off completes, fails, or its lease runs out, so
a peer that dies never leaks them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    deadline: float


class LeaseBook:
    """Requests whose blocks are held under a lease."""

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        self._held: dict[str, Request] = {}
        self.num_expired = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request: Request, lease_s: float) -> None:
        """Put a request's blocks under a lease of `lease_s` seconds from now."""
        request.lease_deadline = time.monotonic() + lease_s
        self._held[request.request_id] = request

    def take(self, request_id: str) -> Request:
        """Remove a live lease (the blocks stay allocated); LeaseError if unknown."""
        request = self._held.pop(request_id, None)
        if request is None:
            raise LeaseError(f"no lease for request {request_id!r} (unknown or expired)")
        return request

    def release(self, request_id: str) -> Request | None:
        """End a lease and free its blocks; None if there was none."""
        request = self._held.pop(request_id, None)
        if request is not None:
            self.kv_cache.free(request_id)
        return request

    def expire(self, now: float | None = None) -> list[Request]:
        """Free the blocks of every lease past its deadline."""
        now = time.monotonic() if now is None else now
        expired = [r for r in self._held.values() if (r.lease_deadline or now) < now]
        for request in expired:
            self.release(request.request_id)
        self.num_expired += len(expired)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline among live leases."""
        return min((r.lease_deadline or 0.0 for r in self._held.values()), default=None)
