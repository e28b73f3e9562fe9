"""Reconciling a ServingPool: render, apply what differs, prune, report.

The kopf handlers (handlers.py) call in here with the pool and the children the
operator's watches have cached; this module decides what to write. Writes are
server-side applies of whole objects (field manager `pdserve`, forced), skipped when
the live object is already up to date (drift.py), so a resync or a restart writes
nothing. One lock per pool keeps a pool's reconciles from interleaving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pdserve.operator import api, metrics, render
from pdserve.operator.controller import drift, kube
from pdserve.operator.controller import status as pool_status
from pdserve.operator.controller.kube import ApiError, KubeClient
from pdserve.operator.rollout import changes as revision_changes
from pdserve.operator.rollout import events as rollout_events
from pdserve.operator.rollout import handover
from pdserve.operator.rollout.events import Recorder
from pdserve.operator.scaling.round import planner_scales

Obj = dict[str, Any]
Key = tuple[str, str]  # (kind, name)

log = logging.getLogger(__name__)

CREDENTIAL_CONFLICT = "SecretConflict"  # the reason of the condition naming it


@dataclass
class _PoolState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    status: dict[str, Any] | None = None  # the status last written
    # The pool's credential Secret, once the operator knows it made it (None: not yet).
    credential: api.CreatedSecret | None = None
    conflict: str | None = None  # why the pool's credential Secret is not its own
    failure: str | None = None  # why the last reconcile had a write refused
    generation: int | None = None  # the pool's generation the last reconcile applied
    # The planner's replica counts (None: not read from the status yet).
    replicas: dict[api.Role, int] | None = None
    # The spec of one generation, and the rendered children of one generation,
    # replica counts, rollout status and kept revisions: child events need them often.
    spec: tuple[int | None, api.ServingPoolSpec] | None = None
    rendered: tuple[object, api.ServingPoolSpec, dict[Key, Obj]] | None = None
    # The rollouts the last rendering was made for (written with the next status).
    rollout: api.RolloutStatus | None = None
    # (generation, resourceVersion) of each child as the last write left it: tells
    # stale watch events and writes that changed nothing.
    written: dict[Key, tuple[int | None, str]] = field(default_factory=dict)

    def record(self, live: Mapping[str, Any]) -> bool:
        """Remember a write's result; whether it changed the object (a new version)."""
        meta = live["metadata"]
        before = self.written.get(key_of(live))
        self.written[key_of(live)] = (meta.get("generation"), meta["resourceVersion"])
        return before is None or before[1] != meta["resourceVersion"]

    def stale(self, child: Mapping[str, Any]) -> bool:
        """Whether a watch event predates the operator's last write of the object."""
        written = self.written.get(key_of(child))
        generation = child["metadata"].get("generation")
        if written is None or written[0] is None or generation is None:
            return False
        return bool(generation < written[0])


def key_of(obj: Mapping[str, Any]) -> Key:
    """An object's identity among a pool's children."""
    return obj["kind"], obj["metadata"]["name"]


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether the pool with this uid owns the object."""
    refs = obj.get("metadata", {}).get("ownerReferences", [])
    return any(ref.get("uid") == uid for ref in refs)


def desired_objects(
    pool: Mapping[str, Any],
    spec: api.ServingPoolSpec,
    replicas: Mapping[api.Role, int] | None = None,
    prometheus_url: str | None = None,
    prometheus_namespace: str | None = None,
    rollout: api.RolloutStatus | None = None,
    live: Mapping[str, Obj] | None = None,
) -> dict[Key, Obj]:
    """The pool's children as they should be: rendered (with the planner's replica
    counts, the rollouts' revisions), owned, stamped with their hash."""
    meta = pool["metadata"]
    rendered = render.render(
        meta["name"], meta["namespace"], spec, replicas,
        prometheus_url=prometheus_url, prometheus_namespace=prometheus_namespace,
        rollout=rollout, live=live,
    )  # fmt: skip
    objects = (drift.stamped(render.with_owner(obj, meta)) for obj in rendered)
    return {key_of(obj): obj for obj in objects}


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    """An object's labels."""
    found: Mapping[str, str] = obj["metadata"].get("labels") or {}
    return found


def canary_revisions(pool: Mapping[str, Any], spec: api.ServingPoolSpec) -> dict[api.Role, str]:
    """The revision each role with the canary strategy should run."""
    meta = pool["metadata"]
    return {
        role: render.worker_revision(meta["name"], meta["namespace"], spec, role)
        for role in render.ROLES
        if (workers := spec.pool(role)) is not None and workers.rollout.type == "canary"
    }


def planned_replicas(pool: Mapping[str, Any]) -> dict[api.Role, int]:
    """The replica counts of the planner's last decisions, as the pool's status keeps
    them (so a restarted operator goes on from there)."""
    scaling = pool_status.previous_status(pool.get("status")).autoscaling
    if scaling is None:
        return {}
    counts: dict[api.Role, int] = {}
    for role in render.ROLES:
        decided = scaling.role(role)
        if decided is not None:
            counts[role] = decided.replicas
    return counts


def describe(changes: Iterable[tuple[str, Obj]]) -> str:
    """ "created Deployment a, updated ConfigMap b" for an Event message."""
    return ", ".join(f"{action} {obj['kind']} {obj['metadata']['name']}" for action, obj in changes)


class Reconciler:
    """Applies pools' desired objects and keeps their status; shared by all handlers."""

    def __init__(
        self,
        client: KubeClient,
        recorder: Recorder,
        *,
        served: Collection[kube.Kind] = (),
        default_image: str | None = None,
        prometheus_url: str | None = None,
        prometheus_namespace: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._client = client
        self._clock = clock
        self._recorder = recorder
        # The kinds of kube.OPTIONAL_KINDS the cluster serves (their CRDs are installed).
        self._served = [kind for kind in kube.OPTIONAL_KINDS if kind in served]
        self._default_image = default_image  # for pools that name no image
        self._prometheus_url = prometheus_url  # for KEDA, where a pool names none
        # Where the Prometheus scraping the pools runs, where a pool names none.
        self._prometheus_namespace = prometheus_namespace
        self._pools: dict[str, _PoolState] = {}

    async def close(self) -> None:
        """Release the API connections."""
        await self._client.close()

    def _state(self, pool: Mapping[str, Any]) -> _PoolState:
        """The pool's state, made on first use. Only the entry points (reconcile,
        child_changed) call this, once each, and pass the state down: a pool forgotten
        while they run is then not brought back by their remaining steps."""
        return self._pools.setdefault(pool["metadata"]["uid"], _PoolState())

    def _rendered(
        self, pool: Mapping[str, Any], state: _PoolState, children: Iterable[Obj]
    ) -> tuple[api.ServingPoolSpec, dict[Key, Obj]]:
        """The pool's parsed spec and desired children (cached per generation, replica
        counts, rollouts and kept revisions; callers must not modify them); a change
        of a canary role's revision starts, restarts or ends its rollout
        (`state.rollout`). Raises api.InvalidPoolError."""
        generation = pool["metadata"].get("generation")
        if state.replicas is None:
            state.replicas = planned_replicas(pool)
        spec = self._spec(pool, state)
        previous = pool_status.previous_status(self._last_status(pool, state)).rollout
        revisions = canary_revisions(pool, spec)
        now = self._clock().replace(microsecond=0)
        rollout = revision_changes.pool_change(spec, previous, revisions, now)
        live = {
            obj["metadata"]["name"]: obj
            for obj in children
            if obj["kind"] == kube.DEPLOYMENT.kind and render.REVISION_LABEL in labels_of(obj)
        }
        key = (
            generation,
            tuple(sorted(state.replicas.items())),
            None if rollout is None else json.dumps(api.dump(rollout), sort_keys=True),
            tuple(sorted((name, obj["metadata"].get("generation")) for name, obj in live.items())),
        )
        if state.rendered is None or state.rendered[0] != key or generation is None:
            planned = state.replicas if planner_scales(spec) else None
            desired = desired_objects(
                pool, spec, planned, self._prometheus_url, self._prometheus_namespace,
                rollout, live,
            )  # fmt: skip
            state.rendered = (key, spec, desired)
        state.rollout = rollout
        return state.rendered[1], state.rendered[2]

    def _spec(self, pool: Mapping[str, Any], state: _PoolState) -> api.ServingPoolSpec:
        """The pool's spec, parsed once per generation (raises api.InvalidPoolError)."""
        generation = pool["metadata"].get("generation")
        if state.spec is None or state.spec[0] != generation or generation is None:
            spec = api.with_image(api.parse_spec(pool["spec"]), self._default_image)
            state.spec = (generation, spec)
        return state.spec[1]

    def replicas(self, pool: Mapping[str, Any]) -> dict[api.Role, int]:
        """The planner's replica counts of a pool (from its status after a restart)."""
        state = self._state(pool)
        if state.replicas is None:
            state.replicas = planned_replicas(pool)
        return dict(state.replicas)

    def status_of(self, pool: Mapping[str, Any]) -> api.ServingPoolStatus:
        """The pool's status as the operator last wrote (or, before that, read) it."""
        state = self._pools.get(pool["metadata"]["uid"])
        written = state.status if state is not None and state.status is not None else None
        return pool_status.previous_status(written or pool.get("status"))

    def scale(self, pool: Mapping[str, Any], replicas: Mapping[api.Role, int]) -> None:
        """Set the planner's replica counts; the next reconcile applies them."""
        state = self._state(pool)
        state.replicas = {**(state.replicas or planned_replicas(pool)), **replicas}

    async def report(self, pool: Mapping[str, Any], report: pool_status.ScalingReport) -> None:
        """Write what the autoscaler found (its conditions and decision) to the status."""
        state = self._state(pool)
        async with state.lock:
            previous = pool_status.previous_status(self._last_status(pool, state))
            new = pool_status.with_scaling(previous, report)
            await self._patch_status(pool, state, new)

    def forget(self, uid: str) -> None:
        """Drop what is remembered about a deleted pool."""
        self._pools.pop(uid, None)

    def tracked(self) -> frozenset[str]:
        """The uids of the pools the reconciler holds state for."""
        return frozenset(self._pools)

    async def reconcile(
        self, pool: Mapping[str, Any], children: Iterable[Obj], *, trigger: str
    ) -> None:
        """Bring every child of the pool to its rendered state and update the status.

        Raises api.InvalidPoolError for a spec the operator refuses and ApiError when
        the API server refuses a write (after recording both in the status).
        """
        started = time.perf_counter()
        metrics.RECONCILES.labels(trigger=trigger).inc()
        state = self._state(pool)
        try:
            async with state.lock:
                await self._reconcile(pool, state, children)
        except api.InvalidPoolError:
            metrics.RECONCILE_ERRORS.labels(trigger=trigger, reason="InvalidSpec").inc()
            raise
        except ApiError as error:
            metrics.RECONCILE_ERRORS.labels(trigger=trigger, reason=f"Api{error.status}").inc()
            raise
        finally:
            metrics.RECONCILE_DURATION.labels(trigger=trigger).observe(
                time.perf_counter() - started
            )

    async def _reconcile(
        self, pool: Mapping[str, Any], state: _PoolState, children: Iterable[Obj]
    ) -> None:
        children = list(children)
        try:
            spec, desired = self._rendered(pool, state, children)
        except api.InvalidPoolError as error:
            await self._refuse(pool, state, error)
            raise
        desired = self._servable(pool, desired)
        live = {key_of(obj): obj for obj in children}
        live.update(await self._optional_children(pool))
        kept = handover.kept_deployments(spec, state.rollout, desired.values(), live.values())
        changes: list[tuple[str, Obj]] = []
        errors: list[ApiError] = []
        try:
            changes += await self._ensure_credential(pool, state)
        except ApiError as error:
            errors.append(error)
        # One refused object does not hold back the others: apply all, then report.
        for key, obj in desired.items():
            before = live.get(key)
            if before is not None and drift.up_to_date(obj, before):
                continue
            try:
                live[key], changed = await self._apply(state, obj, before)
            except ApiError as error:
                errors.append(error)
                continue
            if changed:
                changes.append(("updated" if before is not None else "created", obj))
        for key, obj in list(live.items()):
            if key[0] == kube.DEPLOYMENT.kind and key[1] in kept:
                continue  # its successors are not ready yet (handover.py)
            if key not in desired and owned_by(obj, pool["metadata"]["uid"]):
                del live[key]
                try:
                    if await self._client.delete(obj):
                        changes.append(("deleted", obj))
                except ApiError as error:
                    errors.append(error)
        self._report(pool, changes, "Applied")
        state.failure = failure = "; ".join(str(e) for e in errors) or None
        state.generation = pool["metadata"].get("generation")
        await self._write_status(pool, state, spec, live.values())
        if errors:
            raise ApiError(errors[0].status, failure or "", errors[0].reason)

    async def child_changed(
        self, pool: Mapping[str, Any], child: Obj, event: str, children: Iterable[Obj]
    ) -> None:
        """React to a watch event on one child: recreate it if deleted, put it back if
        edited, delete it if no longer rendered; refresh the status on Deployment news.

        Raises ApiError when the API server refuses the repair (counted, and a Warning
        posted): the caller retries later, as no further event may come.
        """
        if pool["metadata"].get("deletionTimestamp"):
            return
        state = self._state(pool)
        key = key_of(child)
        live = {key_of(obj): obj for obj in children}
        if event == "DELETED":
            live.pop(key, None)
        else:
            live[key] = child
        try:
            spec, desired = self._rendered(pool, state, live.values())
        except api.InvalidPoolError:
            return  # the pool's own handler reports it
        async with state.lock:
            try:
                if (state.failure is not None and event == "DELETED") or self._handed_over(
                    pool, spec, state, desired, live.values()
                ):
                    # The last reconcile had a write refused: this may have cleared the
                    # way; or a kept Deployment's successors are now ready.
                    metrics.RECONCILES.labels(trigger="child").inc()
                    await self._reconcile(pool, state, live.values())
                    return
                if event != "DELETED" and state.stale(child):
                    return  # the operator has written a newer version since
                change = await self._repair(pool, state, desired.get(key), child, event)
            except ApiError as error:
                metrics.RECONCILE_ERRORS.labels(trigger="child", reason=f"Api{error.status}").inc()
                self._recorder.warning(pool, "RepairFailed", str(error))
                raise
            if change is not None:
                metrics.RECONCILES.labels(trigger="child").inc()
                self._report(pool, [change], "Repaired")
                if change[0] != "deleted":
                    live[key] = change[1]
            if change is not None or key[0] in (kube.DEPLOYMENT.kind, kube.POD.kind):
                await self._write_status(pool, state, spec, live.values())

    @staticmethod
    def _handed_over(
        pool: Mapping[str, Any],
        spec: api.ServingPoolSpec,
        state: _PoolState,
        desired: Mapping[Key, Obj],
        children: Iterable[Obj],
    ) -> bool:
        """Whether a worker Deployment kept for a handover may now go."""
        uid = pool["metadata"]["uid"]
        departing = {
            key_of(obj)[1]
            for obj in children
            if handover.role_of(obj) is not None and key_of(obj) not in desired
            and owned_by(obj, uid)
        }  # fmt: skip
        if not departing:
            return False
        kept = handover.kept_deployments(spec, state.rollout, desired.values(), children)
        return bool(departing - kept)

    async def _repair(
        self, pool: Mapping[str, Any], state: _PoolState, want: Obj | None, child: Obj, event: str
    ) -> tuple[str, Obj] | None:
        """The write (if any) that puts one child back; (action, object written)."""
        uid = pool["metadata"]["uid"]
        if want is None:
            gone = event == "DELETED" or child["metadata"].get("deletionTimestamp")
            if gone or not owned_by(child, uid) or not await self._client.delete(child):
                return None
            return "deleted", child
        if event == "DELETED":
            # The pool may be going too (garbage collection deletes children after it).
            if not await self._pool_exists(pool):
                return None
            live, _ = await self._apply(state, want, None)
            return "recreated", live
        if drift.up_to_date(want, child):
            return None
        live, changed = await self._apply(state, want, child)
        return ("restored", live) if changed else None

    async def _apply(
        self, state: _PoolState, obj: Obj, before: Mapping[str, Any] | None
    ) -> tuple[Obj, bool]:
        """Apply one object; the live result and whether the write changed it (a write
        from a stale view may find the object already right)."""
        live = await self._client.apply(obj)
        new_version = state.record(live)
        if before is not None:
            new_version = (
                new_version
                and before["metadata"].get("resourceVersion")
                != (live["metadata"]["resourceVersion"])
            )
        return live, new_version

    async def _ensure_credential(
        self, pool: Mapping[str, Any], state: _PoolState
    ) -> list[tuple[str, Obj]]:
        """Make the Secret with the pool's internal credential, once: a random value,
        never rendered, never rewritten (rotating it means deleting the Secret and
        restarting the operator).

        The operator only ever creates Secrets: it never reads, patches or adopts one,
        so it can be denied `get` on Secrets. The Secret is made with pdserve's labels
        and the pool's owner reference; the status records it (`credentialSecret`).
        When one of its name exists that the status does not record (a foreign Secret,
        or one an earlier pool of the same name left for the garbage collector), it is
        left alone and ApiError(409, reason SecretConflict) says so: the Degraded
        condition names the conflict and the reconcile is retried with backoff."""
        if state.credential is not None:
            return []
        meta = pool["metadata"]
        name = render.object_name(meta["name"], "internal")
        secret = render.with_owner(
            render.credential_secret(meta["name"], meta["namespace"], secrets.token_urlsafe(32)),
            meta,
        )
        state.conflict = None
        created = await self._client.create(secret)
        if created is not None:
            state.credential = api.CreatedSecret(name=name, uid=created["metadata"]["uid"])
            return [("created", {**secret, "stringData": {}})]  # no value in Events, logs
        recorded = pool_status.previous_status(self._last_status(pool, state)).credential_secret
        if recorded is not None and recorded.name == name:
            state.credential = recorded
            return []
        state.conflict = (
            f"Secret {meta['namespace']}/{name} exists but was not created for this pool: "
            "pdserve never adopts a Secret; delete or rename it and the operator creates "
            "the pool's credential"
        )
        raise ApiError(409, state.conflict, CREDENTIAL_CONFLICT)

    async def _pool_exists(self, pool: Mapping[str, Any]) -> bool:
        meta = pool["metadata"]
        live = await self._client.get(kube.SERVING_POOL, meta["namespace"], meta["name"])
        return (
            live is not None
            and live["metadata"]["uid"] == meta["uid"]
            and not live["metadata"].get("deletionTimestamp")
        )

    def _servable(self, pool: Mapping[str, Any], desired: dict[Key, Obj]) -> dict[Key, Obj]:
        """The desired objects the cluster can hold (ServiceMonitors and ScaledObjects
        need their CRDs)."""
        served = {kind.kind for kind in self._served}
        missing = {key[0] for key in desired if key[0] in kube.OPTIONAL_NAMES} - served
        for kind in sorted(missing):
            self._recorder.warning(pool, f"No{kind}CRD", f"the cluster serves no {kind}s: skipped")
        return {k: v for k, v in desired.items() if k[0] not in missing}

    async def _optional_children(self, pool: Mapping[str, Any]) -> dict[Key, Obj]:
        """The pool's objects of optional kinds, read on demand (they are not watched)."""
        meta = pool["metadata"]
        found: dict[Key, Obj] = {}
        for kind in self._served:
            selector = f"{render.POOL_LABEL}={meta['name']}"
            for obj in await self._client.list_objects(kind, meta["namespace"], selector):
                found[key_of(obj)] = obj
        return found

    def _report(self, pool: Mapping[str, Any], changes: list[tuple[str, Obj]], reason: str) -> None:
        for action, obj in changes:
            metrics.OBJECT_CHANGES.labels(kind=obj["kind"], action=action).inc()
        if changes:
            meta = pool["metadata"]
            log.info("%s/%s: %s", meta["namespace"], meta["name"], describe(changes))
            self._recorder.normal(pool, reason, describe(changes))

    async def _refuse(
        self, pool: Mapping[str, Any], state: _PoolState, error: api.InvalidPoolError
    ) -> None:
        state.generation = pool["metadata"].get("generation")
        previous = pool_status.previous_status(self._last_status(pool, state))
        new = pool_status.invalid_status(previous, generation=state.generation, errors=error.errors)
        await self._patch_status(pool, state, new)

    async def _write_status(
        self,
        pool: Mapping[str, Any],
        state: _PoolState,
        spec: api.ServingPoolSpec,
        children: Iterable[Obj],
    ) -> None:
        meta = pool["metadata"]
        children = list(children)
        deployments = {
            obj["metadata"]["name"]: obj for obj in children if obj["kind"] == kube.DEPLOYMENT.kind
        }
        previous = pool_status.previous_status(self._last_status(pool, state))
        # observedGeneration says what the operator has applied: a child event may
        # arrive before the reconcile of a newer spec (or, after a restart, before any).
        generation = state.generation if state.generation else previous.observed_generation
        new = pool_status.pool_status(
            previous,
            pool=meta["name"],
            namespace=meta["namespace"],
            generation=generation,
            spec=spec,
            deployments=deployments,
            pods=[obj for obj in children if obj["kind"] == kube.POD.kind],
            replicas=state.replicas if planner_scales(spec) else None,
            written={
                name: gen
                for (kind, name), (gen, _) in state.written.items()
                if kind == kube.DEPLOYMENT.kind and gen is not None
            },
            failure=state.failure,
            credential=state.credential,
            conflict=state.conflict,
            expected=handover.expected_counts(state.rendered[2].values() if state.rendered else ()),
        )
        await self._patch_status(pool, state, new.model_copy(update={"rollout": state.rollout}))

    async def update_rollout(
        self,
        pool: Mapping[str, Any],
        update: Callable[[api.RolloutStatus | None], api.RolloutStatus | None],
    ) -> bool:
        """Write a rollout round's decisions, `update` applied to the rollouts as the
        status holds them now; whether they changed. The next reconcile renders the
        revisions they call for."""
        state = self._state(pool)
        async with state.lock:
            previous = pool_status.previous_status(self._last_status(pool, state))
            rollout = update(previous.rollout)
            if rollout == previous.rollout:
                return False
            await self._patch_status(pool, state, previous.model_copy(update={"rollout": rollout}))
            state.rollout = rollout
            return True

    @staticmethod
    def _last_status(pool: Mapping[str, Any], state: _PoolState) -> Mapping[str, Any]:
        return state.status if state.status is not None else dict(pool.get("status") or {})

    async def _patch_status(
        self, pool: Mapping[str, Any], state: _PoolState, new: api.ServingPoolStatus
    ) -> None:
        old = self._last_status(pool, state)
        wanted = pool_status.status_change(old, new)
        if wanted is None:
            return
        meta = pool["metadata"]
        written = await self._client.patch_status(
            meta["namespace"], meta["name"], meta["uid"], wanted
        )
        if not written:
            # A reconcile that outlived its pool: the name is another pool's now.
            log.info("%s/%s: deleted, its status not written", meta["namespace"], meta["name"])
            self.forget(meta["uid"])
            return
        state.status = wanted
        self._announce(pool, pool_status.previous_status(old), new)

    def _announce(
        self, pool: Mapping[str, Any], old: api.ServingPoolStatus, new: api.ServingPoolStatus
    ) -> None:
        """Events for the transitions a person watches for: Ready, Degraded, and the
        rollouts' decisions (with their metrics)."""
        rollout_events.announce(self._recorder, pool, old.rollout, new.rollout)
        types: tuple[api.ConditionType, ...] = ("Ready", "Degraded")
        for type_ in types:
            before, after = old.condition(type_), new.condition(type_)
            if after is None or after.status != "True":
                continue
            if before is None or before.status != "True":
                if type_ == "Ready":
                    self._recorder.normal(pool, "Ready", after.message)
                else:
                    self._recorder.warning(pool, after.reason, after.message)
