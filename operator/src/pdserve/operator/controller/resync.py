"""Reconciling pools from a fresh read of the cluster, off the watches' path.

The watches (handlers.py) bring most changes as they happen, but not all of them: a
write the API server refused is followed by no event; a watch that breaks lists
again but never reports what was deleted in between (and kopf's caches keep it);
ServiceMonitors are not watched at all. So one background loop

- retries a pool whose write was refused, after a delay that doubles with each
  failure (1 s, 2 s, ... up to 5 min), reading the pool and its children afresh;
- every `interval` seconds lists every pool and child in the watched namespaces and
  reconciles each pool with what it read. An up-to-date pool costs no write
  (drift.py); pools that no longer exist are forgotten;
- reconciles a pool at once when the autoscaler changed its replica counts (`soon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.operator import api, render
from pdserve.operator.controller import kube
from pdserve.operator.controller.cache import ClusterCache, PoolKey, cached_copy, pool_key
from pdserve.operator.controller.kube import ApiError, KubeClient
from pdserve.operator.controller.reconcile import Reconciler

Obj = dict[str, Any]

RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 300.0

log = logging.getLogger(__name__)


def backoff(attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (0 for the first) of a refused write."""
    return min(RETRY_MAX_SECONDS, RETRY_FIRST_SECONDS * (1 << min(attempt, 32)))


@dataclass
class _Retry:
    attempt: int  # failures so far, less one
    due: float  # on the loop's clock
    trigger: str = "retry"  # what the reconcile counts as (metrics)


class Resync:
    """The background loop of retries and periodic resyncs (see the module's doc)."""

    def __init__(
        self,
        reconciler: Reconciler,
        client: KubeClient,
        cache: ClusterCache,
        *,
        namespaces: Sequence[str],
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reconciler = reconciler
        self._client = client
        self._cache = cache
        self._namespaces: tuple[str | None, ...] = tuple(namespaces) or (None,)
        self._interval = interval
        self._clock = clock
        self._next_resync = clock() + interval
        self._retries: dict[PoolKey, _Retry] = {}
        # Pools deleted while a pass runs: it must not reconcile (and so remember) them.
        self._busy = False
        self._gone: set[PoolKey] = set()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop unless it runs. Call it from a kopf handler: the loop then
        posts Events through kopf's queue, which only the handlers' context reaches."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="pdserve-resync")

    async def close(self) -> None:
        """Stop the loop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def retry(self, key: PoolKey) -> None:
        """Reconcile the pool again after a backoff: a write was refused and no event
        may come. A retry already pending keeps its time."""
        self._gone.discard(key)
        if key not in self._retries:
            self._schedule(key, 0)

    def soon(self, key: PoolKey, trigger: str) -> None:
        """Reconcile the pool from a fresh read as soon as the loop can (e.g. the
        autoscaler changed its replicas); a failure retries with backoff."""
        self._gone.discard(key)
        pending = self._retries.get(key)
        attempt = pending.attempt if pending is not None else 0
        self._retries[key] = _Retry(attempt, self._clock(), trigger)
        self._wakeup.set()

    def forget(self, key: PoolKey) -> None:
        """Drop a deleted pool: its pending retry, and its turn in a pass under way."""
        self._retries.pop(key, None)
        if self._busy:
            self._gone.add(key)

    @contextlib.contextmanager
    def _pass(self) -> Iterator[None]:
        """A pass over some pools: what is deleted meanwhile is skipped, or forgotten
        again once its reconcile ends; nothing of it is kept after the pass."""
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            self._gone.clear()

    @property
    def cache(self) -> ClusterCache:
        """The cache each fresh read refreshes."""
        return self._cache

    def pending(self) -> int:
        """How many pools wait for a retry."""
        return len(self._retries)

    def _schedule(self, key: PoolKey, attempt: int) -> None:
        self._retries[key] = _Retry(attempt, self._clock() + backoff(attempt))
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            await self._sleep()
            try:
                if self._clock() >= self._next_resync:
                    self._next_resync = self._clock() + self._interval
                    await self.resync()
                await self.retry_due()
            except Exception:  # a bug must not end the loop
                log.exception("resync loop")

    async def _sleep(self) -> None:
        """Until the next resync or retry is due, or a retry is scheduled."""
        due = min([self._next_resync, *(retry.due for retry in self._retries.values())])
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), max(0.0, due - self._clock()))

    async def retry_due(self) -> None:
        """Run the retries that are due, each from a fresh read of its pool."""
        now = self._clock()
        due = [key for key, retry in self._retries.items() if retry.due <= now]
        with self._pass():
            for key in due:
                retry = self._retries.pop(key, None)
                if retry is not None:  # else deleted meanwhile
                    await self._retry(key, retry.attempt, retry.trigger)

    async def _retry(self, key: PoolKey, attempt: int, trigger: str) -> None:
        try:
            pool, children = await self._read_pool(key)
        except ApiError as error:
            log.warning("%s/%s: cannot read the pool to retry: %s", *key, error)
            if key not in self._gone:
                self._schedule(key, attempt + 1)
            return
        if pool is not None:
            await self._attempt(key, pool, children, trigger, attempt + 1)

    async def resync(self) -> None:
        """Reconcile every pool with what the API server holds now; forget pools gone."""
        known, waiting = self._reconciler.tracked(), set(self._retries)
        with self._pass():
            try:
                pools, children = await self.refresh_cache()
            except ApiError as error:
                log.warning("resync: cannot list the pools and their children: %s", error)
                return
            for uid in known - {pool["metadata"]["uid"] for pool in pools}:
                self._reconciler.forget(uid)
            for key in waiting - {pool_key(pool) for pool in pools}:
                self._retries.pop(key, None)
            for pool in pools:
                key = pool_key(pool)
                failures = self._retries[key].attempt + 1 if key in self._retries else 0
                await self._attempt(key, pool, children.get(key, []), "resync", failures)

    async def _attempt(
        self, key: PoolKey, pool: Obj, children: list[Obj], trigger: str, failures: int
    ) -> None:
        """Reconcile one pool; on a refusal schedule retry number `failures`."""
        if key in self._gone or pool["metadata"].get("deletionTimestamp"):
            return
        done = await self._reconcile(pool, children, trigger)
        if key in self._gone:  # deleted meanwhile: what the reconcile kept must go too
            self._reconciler.forget(pool["metadata"]["uid"])
        elif done:
            self._retries.pop(key, None)
        else:
            self._schedule(key, failures)

    async def _reconcile(self, pool: Obj, children: list[Obj], trigger: str) -> bool:
        """Whether the pool needs no retry (reconciled, or its spec is invalid: the
        pool's own handler reports that, and a fix comes as an event)."""
        try:
            await self._reconciler.reconcile(pool, children, trigger=trigger)
        except api.InvalidPoolError:
            return True
        except ApiError as error:
            log.warning("%s/%s: %s failed: %s", *pool_key(pool), trigger, error)
            return False
        return True

    async def _read_pool(self, key: PoolKey) -> tuple[Obj | None, list[Obj]]:
        """One pool and its children as the API server holds them (None: no pool)."""
        namespace, name = key
        pool = await self._client.get(kube.SERVING_POOL, namespace, name)
        if pool is None:
            return None, []
        selector = f"{render.POOL_LABEL}={name}"
        children = []
        for kind in kube.WATCHED_KINDS:
            children += await self._client.list_objects(kind, namespace, selector, cached_copy)
        return pool, children

    async def refresh_cache(self) -> tuple[list[Obj], dict[PoolKey, list[Obj]]]:
        """Read every pool and child afresh into the cache; returns what it read."""
        since = self._cache.mark()
        pools, children = await self._read_all()
        self._cache.replace(pools, itertools.chain.from_iterable(children.values()), since)
        return pools, children

    async def _read_all(self) -> tuple[list[Obj], dict[PoolKey, list[Obj]]]:
        """Every pool, and every child by its pool's key, in the watched namespaces, as
        the cache keeps them (a resync over thousands of pools would otherwise hold every
        pod's spec and every object's managedFields at once: the operator's peak memory)."""
        pools: list[Obj] = []
        children: dict[PoolKey, list[Obj]] = defaultdict(list)
        for namespace in self._namespaces:
            pools += await self._client.list_objects(kube.SERVING_POOL, namespace, keep=cached_copy)
            for kind in kube.WATCHED_KINDS:
                listed = await self._client.list_objects(
                    kind, namespace, render.POOL_LABEL, cached_copy
                )
                for obj in listed:
                    meta = obj["metadata"]
                    children[meta["namespace"], meta["labels"][render.POOL_LABEL]].append(obj)
        return pools, children
