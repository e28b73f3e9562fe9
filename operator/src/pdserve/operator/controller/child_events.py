"""Watch events on a pool's children, coalesced per pool.

A pool's children change in bursts (a Deployment's status, then its pods', ...), and
the pool's lock lets one repair run at a time. A handler that waited for the lock
would hold its event's body, kopf's context around it and the pool's rendered objects
all the while: when 2,000 pools were created at once, thousands of such handlers
waited together and held most of the operator's memory. So the handler records the
child's newest event and returns; one task per pool works through what changed, each
child's newest event once, in the order the children first changed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pdserve.operator.controller.cache import PoolKey
from pdserve.operator.controller.reconcile import Key, key_of

Obj = dict[str, Any]
Changed = Mapping[Key, tuple[str, Obj]]  # child: (its newest event's type, its body)
Handle = Callable[[PoolKey, Changed], Awaitable[None]]

log = logging.getLogger(__name__)


class ChildEvents:
    """The children's events each pool has not handled yet, and one task per pool
    handing them to `handle` (which must not raise for one child's failure: what
    escapes it is logged, and the pool's remaining events are still handled)."""

    def __init__(self, handle: Handle) -> None:
        self._handle = handle
        self._pending: dict[PoolKey, dict[Key, tuple[str, Obj]]] = {}
        self._drains: dict[PoolKey, asyncio.Task[None]] = {}

    def note(self, pool: PoolKey, event: str, child: Obj) -> None:
        """A child's event: handled after those already pending for its pool; one
        still pending for the same child is replaced by it."""
        self._pending.setdefault(pool, {})[key_of(child)] = (event, child)
        if pool not in self._drains:
            self._drains[pool] = asyncio.create_task(self._drain(pool), name=f"children {pool}")

    def pending(self) -> int:
        """How many children's events wait to be handled."""
        return sum(len(changed) for changed in self._pending.values())

    async def close(self) -> None:
        """Stop handling: cancel the pools' tasks and wait for them to end."""
        tasks = list(self._drains.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pending.clear()

    async def _drain(self, pool: PoolKey) -> None:
        try:
            # Nothing awaits between the last pop and the finally: an event noted
            # after that pop starts a new task.
            while (changed := self._pending.pop(pool, None)) is not None:
                try:
                    await self._handle(pool, changed)
                except Exception:
                    log.exception("handling the children's events of pool %s/%s failed", *pool)
        finally:
            del self._drains[pool]
