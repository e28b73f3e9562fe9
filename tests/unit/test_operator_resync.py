"""Retries and resyncs (resync.py) and the reconciler's memory of pools (the pool's
credential Secret among it), against an in-memory stand-in for the API server and a
clock the test moves."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from pdserve.operator.controller import kube
from pdserve.operator.controller.cache import ClusterCache
from pdserve.operator.controller.kube import ApiError
from pdserve.operator.controller.reconcile import Reconciler
from pdserve.operator.controller.resync import RETRY_MAX_SECONDS, Resync, backoff
from support.pool_cluster import pool_manifest

Obj = dict[str, Any]
NAMESPACE = "ns"
KEY = (NAMESPACE, "p")
ROUTING = "ConfigMap/p-routing"


class FakeApi:
    """The few requests the reconciler and the resync loop make, on objects held in
    memory (one namespace); every request is logged as "verb Kind/name"."""

    def __init__(self, pool: Obj | None) -> None:
        self.pool = pool
        self.objects: dict[str, Obj] = {}  # by "Kind/name"
        self.requests: list[str] = []
        self.refused: set[str] = set()  # "Kind/name" whose applies are refused
        self.hold: asyncio.Event | None = None  # when given, applies wait for it
        self.status: Obj = {}  # the pool's status, as the patches left it
        self._version = 0

    def writes(self) -> list[str]:
        return [r for r in self.requests if r.split()[0] in ("apply", "delete", "patch")]

    async def apply(self, obj: Mapping[str, Any]) -> Obj:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        self.requests.append(f"apply {name}")
        if self.hold is not None:
            await self.hold.wait()
        if name in self.refused:
            raise ApiError(422, f"{name} is refused", "Invalid")
        self._version += 1
        uid = self.objects.get(name, {}).get("metadata", {}).get("uid", f"uid-{self._version}")
        meta = {**obj["metadata"], "uid": uid, "resourceVersion": str(self._version)}
        self.objects[name] = {**copy.deepcopy(dict(obj)), "metadata": meta}
        return copy.deepcopy(self.objects[name])

    async def create(self, obj: Mapping[str, Any]) -> Obj | None:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        self.requests.append(f"create {name}")
        if name in self.objects:
            return None
        self._version += 1
        meta = {**obj["metadata"], "uid": f"uid-{self._version}"}
        self.objects[name] = {**copy.deepcopy(dict(obj)), "metadata": meta}
        return copy.deepcopy(self.objects[name])

    async def delete(self, obj: Mapping[str, Any]) -> bool:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        self.requests.append(f"delete {name}")
        return self.objects.pop(name, None) is not None

    async def get(self, kind: kube.Kind, namespace: str, name: str) -> Obj | None:
        self.requests.append(f"get {kind.kind}/{name}")
        return copy.deepcopy(self.pool) if kind == kube.SERVING_POOL else None

    async def list_objects(
        self,
        kind: kube.Kind,
        namespace: str | None,
        label_selector: str | None = None,
        keep: Callable[[Obj], Obj] | None = None,
    ) -> list[Obj]:
        self.requests.append(f"list {kind.kind}")
        if kind == kube.SERVING_POOL:
            listed = [] if self.pool is None else [copy.deepcopy(self.pool)]
        else:
            listed = [copy.deepcopy(o) for o in self.objects.values() if o["kind"] == kind.kind]
        return listed if keep is None else [keep(obj) for obj in listed]

    async def patch_status(
        self, namespace: str, name: str, uid: str, status: Mapping[str, Any]
    ) -> bool:
        self.requests.append(f"patch ServingPool/{name}")
        if self.pool is None or self.pool["metadata"]["uid"] != uid:
            return False
        self.status = copy.deepcopy(dict(status))
        return True

    def condition(self, type_: str) -> Obj:
        return next(c for c in self.status.get("conditions", []) if c["type"] == type_)

    async def close(self) -> None:
        pass


class Events:
    """Records the Events the reconciler posts: (type, reason)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def normal(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        self.posted.append(("Normal", reason))

    def warning(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        self.posted.append(("Warning", reason))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def servingpool() -> Obj:
    manifest = pool_manifest("p")
    manifest["metadata"].update(namespace=NAMESPACE, uid="pool-uid", generation=1)
    return manifest


def operator(pool: Obj | None = None) -> tuple[FakeApi, Reconciler, Resync, Clock]:
    api = FakeApi(pool or servingpool())
    clock = Clock()
    reconciler = Reconciler(api, Events())  # type: ignore[arg-type]
    known = ClusterCache()
    loop = Resync(reconciler, api, known, namespaces=[NAMESPACE], interval=300.0, clock=clock)  # type: ignore[arg-type]
    return api, reconciler, loop, clock


async def refused_create(api: FakeApi, reconciler: Reconciler, loop: Resync) -> None:
    """The pool created with its routing ConfigMap refused, and a retry scheduled (as
    the handlers do when a write is refused)."""
    api.refused.add(ROUTING)
    with pytest.raises(ApiError):
        await reconciler.reconcile(api.pool or {}, [], trigger="create")
    loop.retry(KEY)


def test_backoff_doubles_from_one_second_up_to_five_minutes() -> None:
    assert [backoff(n) for n in range(5)] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert backoff(9) == RETRY_MAX_SECONDS == 300.0
    assert backoff(10_000) == RETRY_MAX_SECONDS


async def test_a_refused_write_is_retried_with_backoff_until_it_succeeds() -> None:
    api, reconciler, loop, clock = operator()
    await refused_create(api, reconciler, loop)

    attempts = []
    for _ in range(80):  # 8 s in steps of 0.1 s
        clock.now = round(clock.now + 0.1, 1)
        tried = api.requests.count(f"apply {ROUTING}")
        await loop.retry_due()
        if api.requests.count(f"apply {ROUTING}") > tried:
            attempts.append(clock.now)
        if clock.now == 5.0:
            api.refused.clear()  # whatever was in the way has gone
    assert attempts == [1.0, 3.0, 7.0]
    assert ROUTING in api.objects and loop.pending() == 0
    # Each retry read the pool and its children afresh.
    assert api.requests.count("get ServingPool/p") == 3


async def test_a_pool_deleted_during_its_retry_leaves_nothing_behind() -> None:
    api, reconciler, loop, clock = operator()
    await refused_create(api, reconciler, loop)
    clock.now = 1.0
    api.hold = asyncio.Event()
    retrying = asyncio.create_task(loop.retry_due())
    while not api.requests[-1].startswith("apply"):
        await asyncio.sleep(0)

    # The pool's deletion event arrives while the retry waits for the API server.
    reconciler.forget("pool-uid")
    loop.forget(KEY)
    api.hold.set()
    await retrying

    assert reconciler.tracked() == frozenset() and loop.pending() == 0


async def test_a_pool_forgotten_during_its_reconcile_is_not_brought_back() -> None:
    api, reconciler, _, _ = operator()
    api.hold = asyncio.Event()
    reconciling = asyncio.create_task(reconciler.reconcile(api.pool or {}, [], trigger="create"))
    while not api.requests:
        await asyncio.sleep(0)
    assert reconciler.tracked() == {"pool-uid"}

    reconciler.forget("pool-uid")
    api.hold.set()
    await reconciling
    assert reconciler.tracked() == frozenset()


async def test_a_pool_replaced_during_its_reconcile_keeps_the_new_pools_status() -> None:
    api, reconciler, _, _ = operator()
    deleted = copy.deepcopy(api.pool or {})
    api.hold = asyncio.Event()
    reconciling = asyncio.create_task(reconciler.reconcile(deleted, [], trigger="retry"))
    while not api.requests:
        await asyncio.sleep(0)

    # Deleted, and a pool of the same name created, before the reconcile ends.
    replacement = servingpool()
    replacement["metadata"]["uid"] = "new-pool-uid"
    api.pool, api.status = replacement, {"phase": "Pending"}
    api.hold.set()
    await reconciling
    assert api.status == {"phase": "Pending"}
    assert reconciler.tracked() == frozenset()


async def test_resync_writes_nothing_when_nothing_drifted_and_puts_back_what_did() -> None:
    api, reconciler, loop, _ = operator()
    await reconciler.reconcile(api.pool or {}, [], trigger="create")
    rendered = set(api.objects)
    api.requests.clear()

    await loop.resync()
    assert api.writes() == []
    assert {r.split()[0] for r in api.requests} == {"list"}

    # Deleted without any event reaching the operator (a watch gap).
    del api.objects[ROUTING]
    await loop.resync()
    assert api.writes() == [f"apply {ROUTING}"]
    assert set(api.objects) == rendered


async def test_resync_forgets_pools_that_no_longer_exist() -> None:
    api, reconciler, loop, _ = operator()
    await refused_create(api, reconciler, loop)
    assert reconciler.tracked() == {"pool-uid"} and loop.pending() == 1

    api.pool = None  # deleted while the operator's watch was down
    await loop.resync()
    assert reconciler.tracked() == frozenset() and loop.pending() == 0


async def test_resync_retries_a_pool_whose_write_it_saw_refused() -> None:
    api, reconciler, loop, clock = operator()
    await reconciler.reconcile(api.pool or {}, [], trigger="create")
    del api.objects[ROUTING]
    api.refused.add(ROUTING)

    await loop.resync()
    assert loop.pending() == 1
    api.refused.clear()
    clock.now = backoff(0)
    await loop.retry_due()
    assert ROUTING in api.objects and loop.pending() == 0


SECRET = "Secret/p-internal"


async def test_a_foreign_secret_is_never_adopted_and_the_pool_says_so() -> None:
    api, reconciler, loop, clock = operator()
    foreign = {"kind": "Secret", "metadata": {"name": "p-internal", "uid": "theirs"}}
    api.objects[SECRET] = copy.deepcopy(foreign)
    with pytest.raises(ApiError) as refused:
        await reconciler.reconcile(api.pool or {}, [], trigger="create")
    assert (refused.value.status, refused.value.reason) == (409, "SecretConflict")
    loop.retry(KEY)
    # Tried once, by creating; never read, changed or taken over.
    assert [r for r in api.requests if "Secret/" in r] == [f"create {SECRET}"]
    assert api.objects[SECRET] == foreign
    degraded = api.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "SecretConflict")
    assert "Secret ns/p-internal exists but was not created for this pool" in degraded["message"]
    assert api.status["phase"] == "Degraded" and "credentialSecret" not in api.status
    # The other objects are applied all the same.
    assert ROUTING in api.objects

    # Its owner deletes it: the retry makes the pool's own, and the status records it.
    del api.objects[SECRET]
    clock.now = backoff(0)
    await loop.retry_due()
    created = api.objects[SECRET]
    assert created["metadata"]["ownerReferences"][0]["uid"] == "pool-uid"
    assert created["metadata"]["labels"]["pdserve.dev/pool"] == "p"
    assert api.status["credentialSecret"] == {
        "name": "p-internal", "uid": created["metadata"]["uid"],
    }  # fmt: skip
    assert api.condition("Degraded")["status"] == "False" and loop.pending() == 0


async def test_a_restarted_operator_knows_the_secret_it_made_from_the_status() -> None:
    api, reconciler, _, _ = operator()
    await reconciler.reconcile(api.pool or {}, [], trigger="create")
    made = copy.deepcopy(api.objects[SECRET])

    restarted = Reconciler(api, Events())  # type: ignore[arg-type]
    pool = {**(api.pool or {}), "status": copy.deepcopy(api.status)}
    api.requests.clear()
    await restarted.reconcile(pool, [], trigger="resume")
    assert [r for r in api.requests if "Secret/" in r] == [f"create {SECRET}"]
    assert api.objects[SECRET] == made and api.condition("Degraded")["status"] == "False"


async def test_a_resync_drops_from_the_cache_what_no_watch_said_was_deleted() -> None:
    """The cache the watches feed is primed by a read; a child deleted while no watch
    ran is never reported, and the next resync's read must drop it from the cache."""
    api, reconciler, loop, _ = operator()
    known = loop.cache
    await reconciler.reconcile(api.pool or {}, [], trigger="create")
    await loop.refresh_cache()
    cached = {f"{o['kind']}/{o['metadata']['name']}": o for o in known.children(KEY)}
    watched = {name for name in api.objects if not name.startswith("Secret/")}
    assert set(cached) == watched and known.pool(KEY) is not None
    stale = cached[ROUTING]["metadata"]["uid"]

    del api.objects[ROUTING]  # a watch gap: no event reaches the operator
    await loop.resync()
    uids = {o["metadata"]["uid"] for o in known.children(KEY)}
    assert stale not in uids and len(uids) == len(watched) - 1  # put back since

    api.pool = None  # deleted while no watch ran
    await loop.resync()
    assert known.pool(KEY) is None
