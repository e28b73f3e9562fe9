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
from datetime import UTC, datetime
from typing import Any

import aiohttp

from pdserve.operator import api, disaggregation, metrics, planner, render
from pdserve.operator.prometheus import Prometheus, PrometheusError
from pdserve.operator.promql import PoolQueries
from pdserve.operator.reconcile import Reconciler, Recorder, planner_scales
from pdserve.operator.resync import PoolKey, Resync, pool_key
from pdserve.operator.signals import NoMetricsError, PoolSignals, read
from pdserve.operator.status import ScalingReport, Verdict

Obj = dict[str, Any]

log = logging.getLogger(__name__)

URL_FIX = "set the operator's --prometheus-url or spec.autoscaling.policy.prometheusUrl"


@dataclass
class _Loop:
    """One pool's loop: the pool as last seen, and what wakes the loop early."""

    pool: Obj
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


def _when(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC).replace(microsecond=0)


def remembered(autoscaling: api.AutoscalingStatus | None, now: float) -> planner.Memory:
    """The planner's memory after a restart: when each role last changed (from the
    status), watching from now (a scale-down waits for a whole window)."""
    last_scale: dict[api.Role, float] = {}
    for role in render.ROLES:
        decided = autoscaling.role(role) if autoscaling else None
        if decided is not None and decided.last_scale_time is not None:
            last_scale[role] = decided.last_scale_time.timestamp()
    return planner.Memory(since=now, last_scale=last_scale)


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
        planning, watching = planner_scales(spec), spec.routing.disaggregated
        status = self._reconciler.status_of(pool)
        autoscaling = status.autoscaling if planning else None
        conditions: dict[api.ConditionType, Verdict] = {}
        url = spec.autoscaling.policy.prometheus_url or self._url
        if (planning or watching) and url is None:
            self._unable(
                conditions, planning, watching, "NoPrometheusUrl", f"no Prometheus: {URL_FIX}"
            )
            metrics.SCALING_ROUNDS.labels(result="no_url").inc()
        elif planning or watching:
            assert url is not None
            signals = await self._read(pool, spec, url, conditions, planning, watching)
            if signals is not None:
                if watching:
                    window = spec.autoscaling.policy.window_seconds
                    conditions["DisaggregationActive"] = disaggregation.verdict(
                        signals.disaggregation, window
                    )
                if planning:
                    interval = spec.autoscaling.policy.interval_seconds
                    conditions["ScalingActive"] = Verdict(
                        "True", "MetricsAvailable", f"deciding every {interval}s from {url}"
                    )
                    autoscaling, memory = self._decide(pool, spec, signals, status, memory)
        await self._reconciler.report(pool, ScalingReport(conditions, autoscaling))
        return memory

    @staticmethod
    def _unable(
        conditions: dict[api.ConditionType, Verdict],
        planning: bool,
        watching: bool,
        reason: str,
        message: str,
    ) -> None:
        if planning:
            conditions["ScalingActive"] = Verdict("False", reason, f"{message}; not scaling")
        if watching:
            conditions["DisaggregationActive"] = Verdict("Unknown", reason, message)

    async def _read(
        self,
        pool: Obj,
        spec: api.ServingPoolSpec,
        url: str,
        conditions: dict[api.ConditionType, Verdict],
        planning: bool,
        watching: bool,
    ) -> PoolSignals | None:
        """The pool's signals, or None with the conditions saying why not."""
        meta = pool["metadata"]
        queries = PoolQueries(
            meta["name"], meta["namespace"], spec.autoscaling.policy.window_seconds
        )
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            signals = await read(Prometheus(url, self._session), queries, spec.slo)
        except PrometheusError as error:
            self._unable(conditions, planning, watching, "PrometheusUnreachable", str(error))
            metrics.SCALING_ROUNDS.labels(result="unreachable").inc()
            return None
        except NoMetricsError as error:
            why = (
                f"{error}: check that it scrapes the pool (a ServiceMonitor, or scrape annotations)"
            )
            self._unable(conditions, planning, watching, "NoMetrics", why)
            metrics.SCALING_ROUNDS.labels(result="no_metrics").inc()
            return None
        metrics.SCALING_ROUNDS.labels(result="ok").inc()
        return signals

    def _decide(
        self,
        pool: Obj,
        spec: api.ServingPoolSpec,
        signals: PoolSignals,
        status: api.ServingPoolStatus,
        memory: planner.Memory,
    ) -> tuple[api.AutoscalingStatus, planner.Memory]:
        """The planner's decisions, recorded; the new autoscaling status and memory."""
        now = self._clock()
        counts = render.desired_replicas(spec, self._reconciler.replicas(pool))
        replicas = {}
        for role in render.ROLES:
            role_status = status.prefill if role == "prefill" else status.decode
            ready = role_status.ready_replicas if role_status is not None else 0
            replicas[role] = planner.Replicas(counts[role], ready)
        settings = planner.Settings.of(spec)
        decisions, memory = planner.plan(settings, signals.observation, replicas, memory, now)
        previous = status.autoscaling or api.AutoscalingStatus()
        changed = {role: d.desired for role, d in decisions.items() if d.direction != "none"}
        updated: dict[str, api.RoleScalingStatus] = {
            role: self._role_status(previous.role(role), d, now) for role, d in decisions.items()
        }
        autoscaling = previous.model_copy(update=updated)
        if changed:
            autoscaling = autoscaling.model_copy(
                update={"last_decision_time": _when(now), "inputs": signals.observation.inputs()}
            )
            self._announce(pool, decisions)
            self._reconciler.scale(pool, changed)
            self._resync.soon(pool_key(pool), "scale")
        return autoscaling, memory

    @staticmethod
    def _role_status(
        previous: api.RoleScalingStatus | None, decision: planner.Decision, now: float
    ) -> api.RoleScalingStatus:
        """A role's status after a decision: rewritten when its count or reason change
        (messages carry live numbers: rewriting them every round would be a write per
        round)."""
        if (
            previous is not None
            and decision.direction == "none"
            and (previous.replicas, previous.reason) == (decision.desired, decision.reason)
        ):
            return previous
        last = _when(now) if decision.direction != "none" else None
        return api.RoleScalingStatus(
            replicas=decision.desired,
            reason=decision.reason,
            message=decision.message[:1024],
            last_scale_time=last or (previous.last_scale_time if previous else None),
        )

    def _announce(
        self, pool: Mapping[str, Any], decisions: Mapping[api.Role, planner.Decision]
    ) -> None:
        """An Event, a log line and a metric per change."""
        meta = pool["metadata"]
        for role, decision in decisions.items():
            if decision.direction == "none":
                continue
            what = "ScaledUp" if decision.direction == "up" else "ScaledDown"
            change = f"{role} {decision.current} -> {decision.desired}"
            text = f"{change}: {decision.reason}: {decision.message}"
            log.info("%s/%s: %s", meta["namespace"], meta["name"], text)
            self._recorder.normal(pool, what, text)
            metrics.SCALING_DECISIONS.labels(
                role=role, direction=decision.direction, reason=decision.reason
            ).inc()
