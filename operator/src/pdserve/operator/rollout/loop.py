"""The operator's rollout loop: one background loop per pool, beside the autoscaler's.

Each round, for every role whose rollout is in progress, it asks for the analysis of
the step's window so far (`pdserve.operator.rollout.analysis`, from Prometheus), takes
the pool's manual command (manual.py) and decides (decision.py): wait, promote,
complete, roll back or abort. A decision other than a wait with the same reason is
written to `status.rollout` (which the reconciler's Events and metrics announce), and
the pool is reconciled at once so its Deployments and routing table follow.

No analysis (no Prometheus configured or reachable, or no figures yet): the rollout
waits and is never promoted on no evidence; a manual
command still acts. The status is the loop's only memory: a restarted operator goes
on from the step and the step's start it finds there.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pdserve.operator import api, render
from pdserve.operator.controller import kube
from pdserve.operator.controller.cache import PoolKey, pool_key
from pdserve.operator.controller.kube import ApiError, KubeClient
from pdserve.operator.controller.loops import PoolLoops
from pdserve.operator.controller.reconcile import Reconciler
from pdserve.operator.controller.resync import Resync
from pdserve.operator.rollout import analysis, changes, decision, manual
from pdserve.operator.rollout import events as rollout_events
from pdserve.operator.rollout.decision import Analysis
from pdserve.operator.rollout.events import Recorder
from pdserve.operator.scaling.prometheus import Prometheus

Obj = dict[str, Any]

log = logging.getLogger(__name__)

ROUND_SECONDS = 10.0  # while a rollout is in progress
IDLE_SECONDS = 60.0  # otherwise (a change, a command or a new status wakes the loop)


@dataclass(frozen=True)
class AnalysisRequest:
    """What the analysis of one role's step is asked about."""

    prometheus: Prometheus
    pool: str
    namespace: str
    role: api.Role
    status: api.RoleRolloutStatus
    spec: api.ServingPoolSpec
    now: datetime


Analyse = Callable[[AnalysisRequest], Awaitable[Analysis | None]]


async def analyse_step(request: AnalysisRequest) -> Analysis | None:
    """The analysis of a role's step from Prometheus, with the SLO and the bucket
    labels of the routing table the pool's routers read."""
    workers = request.spec.pool(request.role)
    if workers is None:
        return None
    table = render.routing_table(request.pool, request.namespace, request.spec)
    buckets = [table.bucket_label(index) for index in range(len(table.buckets))]
    return await analysis.analyse(
        request.prometheus, request.pool, request.role, request.status, workers.rollout,
        table.slo, buckets, request.now, namespace=request.namespace,
    )  # fmt: skip


def next_status(
    spec: api.ServingPoolSpec,
    rollout: api.RolloutStatus | None,
    analyses: Mapping[api.Role, tuple[str | None, int, Analysis | None]],
    command: decision.Manual | None,
    now: datetime,
) -> api.RolloutStatus | None:
    """The rollouts after a round (pure): each role in progress decided on its
    analysis (used only if made for the canary and step still in force) and the
    command. A wait changes nothing when the step's last decision is a promotion (it
    stays what the status says moved the rollout) or a wait for the same reason
    (messages carry live figures: rewriting them would be a write per round)."""
    if rollout is None:
        return None
    roles: dict[str, api.RoleRolloutStatus | None] = {}
    for role in api.ROLES:
        status, workers = rollout.role(role), spec.pool(role)
        roles[role] = status
        if status is None or workers is None or status.phase not in decision.ACTIVE:
            continue
        canary, step, analysis = analyses.get(role, (None, -1, None))
        if (canary, step) != (status.canary_revision, status.step):
            analysis = None
        new = decision.decide(workers.rollout, status, analysis, now, command)
        if not _same_wait(status, new):
            roles[role] = new
    updated = changes.with_phase(api.RolloutStatus.model_validate(roles))
    return updated if updated != rollout else rollout


def _same_wait(old: api.RoleRolloutStatus, new: api.RoleRolloutStatus) -> bool:
    before, after = old.last_decision, new.last_decision
    if after is None or after.action != "wait" or before is None:
        return False
    if (old.phase, old.step) != (new.phase, new.step):
        return False
    return before.action != "wait" or before.reason == after.reason


@dataclass
class _Commands:
    """What a pool's loop remembers of its manual commands."""

    acted: str | None = None  # the record as this loop last wrote it
    warned: str | None = None  # the invalid value last warned about


class Rollouts(PoolLoops):
    """The rollout loops of every pool (see the module's doc)."""

    name = "rollouts"

    def __init__(
        self,
        reconciler: Reconciler,
        resync: Resync,
        client: KubeClient,
        recorder: Recorder,
        *,
        prometheus_url: str | None,
        analyse: Analyse | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__()
        self._reconciler = reconciler
        self._resync = resync
        self._client = client
        self._recorder = recorder
        self._url = prometheus_url
        self._analyse = analyse if analyse is not None else analyse_step
        self._clock = clock
        self._commands: dict[PoolKey, _Commands] = {}

    def track(self, pool: Obj) -> None:
        """Follow a pool; its rollout gauges hold from its status (after a restart,
        before any decision)."""
        key = pool_key(pool)
        rollout_events.observe(key[0], key[1], self._reconciler.status_of(pool).rollout)
        super().track(pool)

    def wakes(self, old: Obj, new: Obj) -> bool:
        """A new spec, command or rollout status is acted on at once."""
        return _fingerprint(old) != _fingerprint(new)

    def forget(self, key: PoolKey) -> None:
        """Stop a deleted pool's loop."""
        super().forget(key)
        self._commands.pop(key, None)

    async def run(self, key: PoolKey) -> None:
        """A pool's rounds: every ROUND_SECONDS while a rollout is in progress."""
        while (loop := self.loop(key)) is not None:
            try:
                interval = await self.round(loop.pool)
            except ApiError as error:
                log.warning("%s/%s: rollout round: %s", *key, error)
                interval = ROUND_SECONDS
            except Exception:  # a bug must not end the loop
                log.exception("%s/%s: rollout round", *key)
                interval = ROUND_SECONDS
            await self.sleep(loop, interval)

    async def round(self, pool: Obj) -> float:
        """One round for one pool; the seconds until the next."""
        commands = self._commands.setdefault(pool_key(pool), _Commands())
        try:
            spec = api.parse_spec(pool["spec"])
        except api.InvalidPoolError:
            return IDLE_SECONDS  # the pool's own handler says why
        rollout = self._reconciler.status_of(pool).rollout
        annotations = pool["metadata"].get("annotations") or {}
        wanted = manual.pending(annotations, commands.acted)
        active = changes.in_progress(rollout)
        now = self._clock().replace(microsecond=0)
        analyses = await self._analyses(pool, spec, rollout, active, now)
        command = wanted.command if active else None

        def update(current: api.RolloutStatus | None) -> api.RolloutStatus | None:
            return next_status(spec, current, analyses, command, now)

        if active and await self._reconciler.update_rollout(pool, update):
            self._resync.soon(pool_key(pool), "rollout")
        if wanted.changed:
            await self._record(pool, commands, wanted)
        return ROUND_SECONDS if active else IDLE_SECONDS

    async def _analyses(
        self,
        pool: Obj,
        spec: api.ServingPoolSpec,
        rollout: api.RolloutStatus | None,
        roles: list[api.Role],
        now: datetime,
    ) -> dict[api.Role, tuple[str | None, int, Analysis | None]]:
        """Each role's analysis, with the canary and step it was made for."""
        found: dict[api.Role, tuple[str | None, int, Analysis | None]] = {}
        url = spec.autoscaling.policy.prometheus_url or self._url
        if rollout is None or url is None or self._analyse is None:
            return found
        meta = pool["metadata"]
        for role in roles:
            status = rollout.role(role)
            assert status is not None
            request = AnalysisRequest(
                Prometheus(url, self.session()), meta["name"], meta["namespace"], role,
                status, spec, now,
            )  # fmt: skip
            try:
                analysis = await self._analyse(request)
            except Exception:  # no figures this round: the rollout waits
                log.exception("%s/%s: %s rollout analysis", meta["namespace"], meta["name"], role)
                analysis = None
            found[role] = (status.canary_revision, status.step, analysis)
        return found

    async def _record(self, pool: Obj, commands: _Commands, wanted: manual.Pending) -> None:
        """Record the command acted on (or its removal) on the pool."""
        meta = pool["metadata"]
        if wanted.invalid is not None and wanted.invalid != commands.warned:
            commands.warned = wanted.invalid
            self._recorder.warning(
                pool, "InvalidRolloutCommand",
                f"{manual.ANNOTATION}={wanted.invalid!r}: expected promote or abort",
            )  # fmt: skip
        written = await self._client.patch_annotations(
            kube.SERVING_POOL, meta["namespace"], meta["name"], meta["uid"],
            {manual.ACTED_ANNOTATION: wanted.record},
        )  # fmt: skip
        if written:  # else the pool was deleted: its DELETED event forgets it
            commands.acted = wanted.record


def _fingerprint(pool: Mapping[str, Any]) -> tuple[object, ...]:
    meta = pool["metadata"]
    annotations = meta.get("annotations") or {}
    rollout = (pool.get("status") or {}).get("rollout")
    return (
        meta.get("generation"),
        annotations.get(manual.ANNOTATION),
        annotations.get(manual.ACTED_ANNOTATION),
        repr(rollout),
    )
