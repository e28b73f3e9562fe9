"""The autoscaler: one background loop per pool that reads the pool's signals from
Prometheus every `autoscaling.policy.intervalSeconds` and

- with the planner (`autoscaling.enabled`, policy type planner), decides each role's
  replicas (planner.py) and records every change in the pool's status (inputs,
  outputs, reason), as an Event and in a metric, then has the pool reconciled so the
  Deployments get the new counts;
- for a pool with disaggregated buckets, sets the `DisaggregationActive` condition
  (disaggregation.py);
- says in the `ScalingActive` condition why it cannot decide (no Prometheus URL,
  Prometheus unreachable, no series of the pool): it then changes nothing.

The loops run beside kopf's handlers, as the resync loop does (kopf timers would add
finalizers), and never block one: a loop sleeps between rounds, and a round's I/O is
Prometheus queries and one status write at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.operator import api, metrics, render
from pdserve.operator.controller.reconcile import Reconciler
from pdserve.operator.controller.resync import PoolKey, Resync, pool_key
from pdserve.operator.controller.status import ScalingReport
from pdserve.operator.rollout.events import Recorder
from pdserve.operator.scaling import planner
from pdserve.operator.scaling.promql import PoolQueries
from pdserve.operator.scaling.round import (
    Outcome,
    change_text,
    decide,
    planner_scales,
    read_pool,
    remembered,
)
from pdserve.operator.scaling.signals import PoolSignals

Obj = dict[str, Any]

log = logging.getLogger(__name__)


@dataclass
class _Loop:
    """One pool's loop: the pool as last seen, and what wakes the loop early."""

    pool: Obj
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Autoscaler:
    """The loops of every pool (see the module's doc)."""

    def __init__(
        self,
        reconciler: Reconciler,
        resync: Resync,
        recorder: Recorder,
        *,
        prometheus_url: str | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._reconciler = reconciler
        self._resync = resync
        self._recorder = recorder
        self._url = prometheus_url
        self._clock = clock
        self._loops: dict[PoolKey, _Loop] = {}
        self._session: aiohttp.ClientSession | None = None

    def track(self, pool: Obj) -> None:
        """Follow a pool (from its watch events): start its loop, or give it the pool's
        latest state (a new spec is acted on at once). Call it from a kopf handler: the
        loop then posts Events through kopf's queue."""
        key = pool_key(pool)
        if pool["metadata"].get("deletionTimestamp"):
            self.forget(key)
            return
        loop = self._loops.get(key)
        if loop is None:
            loop = self._loops[key] = _Loop(pool)
            loop.task = asyncio.create_task(self._run(key), name=f"autoscaler {key[0]}/{key[1]}")
            return
        if pool["metadata"].get("generation") != loop.pool["metadata"].get("generation"):
            loop.wakeup.set()
        loop.pool = pool

    def forget(self, key: PoolKey) -> None:
        """Stop a deleted pool's loop."""
        loop = self._loops.pop(key, None)
        if loop is not None and loop.task is not None:
            loop.task.cancel()

    async def close(self) -> None:
        """Stop every loop and close the connections to Prometheus."""
        tasks = [loop.task for loop in self._loops.values() if loop.task is not None]
        self._loops.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    async def _run(self, key: PoolKey) -> None:
        memory: planner.Memory | None = None
        while (loop := self._loops.get(key)) is not None:
            interval = api.ScalingPolicy().interval_seconds
            try:
                spec = api.parse_spec(loop.pool["spec"])
            except api.InvalidPoolError:
                spec = None  # the pool's own handler says why
            if spec is not None:
                interval = spec.autoscaling.policy.interval_seconds
                if memory is None:
                    status = self._reconciler.status_of(loop.pool)
                    memory = remembered(status.autoscaling, self._clock())
                try:
                    memory = await self.evaluate(loop.pool, spec, memory)
                except Exception:  # a bug must not end the loop
                    log.exception("%s/%s: autoscaler round", *key)
            loop.wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(loop.wakeup.wait(), interval)

    async def evaluate(
        self, pool: Obj, spec: api.ServingPoolSpec, memory: planner.Memory
    ) -> planner.Memory:
        """One round for one pool: read, decide, record; the planner's new memory."""
        meta, policy = pool["metadata"], spec.autoscaling.policy
        queries = PoolQueries(meta["name"], meta["namespace"], policy.window_seconds)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        reading = await read_pool(self._session, policy.prometheus_url or self._url, queries, spec)
        if reading.result != "idle":
            metrics.SCALING_ROUNDS.labels(result=reading.result).inc()
        status = self._reconciler.status_of(pool)
        autoscaling = status.autoscaling if planner_scales(spec) else None
        if reading.signals is not None and planner_scales(spec):
            outcome = self._decide(pool, spec, reading.signals, status, memory)
            autoscaling, memory = outcome.autoscaling, outcome.memory
        await self._reconciler.report(pool, ScalingReport(reading.conditions, autoscaling))
        return memory

    def _decide(
        self,
        pool: Obj,
        spec: api.ServingPoolSpec,
        signals: PoolSignals,
        status: api.ServingPoolStatus,
        memory: planner.Memory,
    ) -> Outcome:
        """The planner's decisions, acted on: the Deployments get the new counts."""
        counts = render.desired_replicas(spec, self._reconciler.replicas(pool))
        replicas = {}
        for role in render.ROLES:
            role_status = status.prefill if role == "prefill" else status.decode
            ready = role_status.ready_replicas if role_status is not None else 0
            replicas[role] = planner.Replicas(counts[role], ready)
        outcome = decide(spec, signals, replicas, status.autoscaling, memory, self._clock())
        if outcome.changes:
            self._announce(pool, outcome.decisions)
            self._reconciler.scale(pool, outcome.changes)
            self._resync.soon(pool_key(pool), "scale")
        return outcome

    def _announce(
        self, pool: Mapping[str, Any], decisions: Mapping[api.Role, planner.Decision]
    ) -> None:
        """An Event, a log line and a metric per change."""
        meta = pool["metadata"]
        for role, decision in decisions.items():
            if decision.direction == "none":
                continue
            text = change_text(decision)
            log.info("%s/%s: %s", meta["namespace"], meta["name"], text)
            self._recorder.normal(
                pool, "ScaledUp" if decision.direction == "up" else "ScaledDown", text
            )
            metrics.SCALING_DECISIONS.labels(
                role=role, direction=decision.direction, reason=decision.reason
            ).inc()
