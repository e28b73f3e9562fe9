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

The loops run beside kopf's handlers (controller/loops.py) and never block one: a
loop sleeps between rounds, and a round's I/O is Prometheus queries and one status
write at most.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from pdserve.operator import api, metrics, render
from pdserve.operator.controller.cache import PoolKey, pool_key
from pdserve.operator.controller.loops import PoolLoops
from pdserve.operator.controller.reconcile import Reconciler
from pdserve.operator.controller.resync import Resync
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


class Autoscaler(PoolLoops):
    """The loops of every pool (see the module's doc)."""

    name = "autoscaler"

    def __init__(
        self,
        reconciler: Reconciler,
        resync: Resync,
        recorder: Recorder,
        *,
        prometheus_url: str | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self._reconciler = reconciler
        self._resync = resync
        self._recorder = recorder
        self._url = prometheus_url
        self._clock = clock

    async def run(self, key: PoolKey) -> None:
        """A pool's rounds, every `autoscaling.policy.intervalSeconds`."""
        memory: planner.Memory | None = None
        while (loop := self.loop(key)) is not None:
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
            await self.sleep(loop, interval)

    async def evaluate(
        self, pool: Obj, spec: api.ServingPoolSpec, memory: planner.Memory
    ) -> planner.Memory:
        """One round for one pool: read, decide, record; the planner's new memory."""
        meta, policy = pool["metadata"], spec.autoscaling.policy
        queries = PoolQueries(meta["name"], meta["namespace"], policy.window_seconds)
        url = policy.prometheus_url or self._url
        reading = await read_pool(self.session(), url, queries, spec)
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
