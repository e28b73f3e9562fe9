"""Background loops, one per pool, beside kopf's handlers (the autoscaler's and the
rollouts'): kopf timers would add finalizers, and a loop must never block a handler.

A loop is started by the pool's first watch event (`track`), is given the pool's
latest state by the next ones (and woken early when they change what it acts on),
and is stopped with the pool (`forget`) or the operator (`close`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.operator.controller.cache import PoolKey, pool_key

Obj = dict[str, Any]


@dataclass
class PoolLoop:
    """One pool's loop: the pool as last seen, and what wakes the loop early."""

    pool: Obj
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class PoolLoops:
    """The loops of every pool; subclasses say what a loop does (`run`) and which
    changes wake it (`wakes`)."""

    name = "loop"

    def __init__(self) -> None:
        self._loops: dict[PoolKey, PoolLoop] = {}
        self._session: aiohttp.ClientSession | None = None

    def track(self, pool: Obj) -> None:
        """Follow a pool (from its watch events): start its loop, or give it the pool's
        latest state. Call it from a kopf handler: the loop then posts Events through
        kopf's queue."""
        key = pool_key(pool)
        if pool["metadata"].get("deletionTimestamp"):
            self.forget(key)
            return
        loop = self._loops.get(key)
        if loop is None:
            loop = self._loops[key] = PoolLoop(pool)
            loop.task = asyncio.create_task(self.run(key), name=f"{self.name} {key[0]}/{key[1]}")
            return
        if self.wakes(loop.pool, pool):
            loop.wakeup.set()
        loop.pool = pool

    def wakes(self, old: Obj, new: Obj) -> bool:
        """Whether a pool's new state is acted on at once: a new spec."""
        return bool(new["metadata"].get("generation") != old["metadata"].get("generation"))

    async def run(self, key: PoolKey) -> None:
        """A pool's loop, until the pool is forgotten."""
        raise NotImplementedError

    def loop(self, key: PoolKey) -> PoolLoop | None:
        """A pool's loop (None once forgotten)."""
        return self._loops.get(key)

    async def sleep(self, loop: PoolLoop, seconds: float) -> None:
        """Wait `seconds`, or less when the pool's loop is woken."""
        loop.wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(loop.wakeup.wait(), seconds)

    def session(self) -> aiohttp.ClientSession:
        """The HTTP session the loops share (to Prometheus)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def forget(self, key: PoolKey) -> None:
        """Stop a deleted pool's loop."""
        loop = self._loops.pop(key, None)
        if loop is not None and loop.task is not None:
            loop.task.cancel()

    async def close(self) -> None:
        """Stop every loop and close the HTTP session."""
        tasks = [loop.task for loop in self._loops.values() if loop.task is not None]
        self._loops.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
