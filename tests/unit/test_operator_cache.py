"""The operator's cache of pools and children (cache.py): what the watches bring, what a
fresh read replaces, and what it must not bring back."""

from __future__ import annotations

from typing import Any

import kopf

from pdserve.operator import render
from pdserve.operator.controller import handlers
from pdserve.operator.controller.cache import ClusterCache
from pdserve.operator.controller.status import pod_trouble

Obj = dict[str, Any]
KEY = ("ns", "p")


def pool(uid: str = "pool-1") -> Obj:
    return {"kind": "ServingPool", "metadata": {"namespace": "ns", "name": "p", "uid": uid}}


def child(name: str, kind: str = "ConfigMap") -> Obj:
    labels = {render.POOL_LABEL: "p", "app.kubernetes.io/component": "decode"}
    meta = {"namespace": "ns", "name": name, "uid": f"uid-{name}", "labels": labels}
    return {"kind": kind, "metadata": {**meta, "managedFields": [{"manager": "x"}]}}


def names(cache: ClusterCache) -> set[str]:
    return {obj["metadata"]["name"] for obj in cache.children(KEY)}


def crashing_pod() -> Obj:
    pod = child("p-decode-abc", kind="Pod")
    pod["spec"] = {"containers": [{"name": "worker", "env": [{"name": "X", "value": "y" * 500}]}]}
    waiting = {"reason": "CrashLoopBackOff", "message": "back-off"}
    container = {"name": "worker", "restartCount": 7, "state": {"waiting": waiting}}
    pod["status"] = {"phase": "Running", "containerStatuses": [container], "podIP": "10.0.0.9"}
    return pod


def test_the_watches_add_change_and_remove_children() -> None:
    cache = ClusterCache()
    cache.put_pool(pool())
    cache.put_child(child("a"))
    cache.put_child(child("b"))
    changed = child("a")
    changed["data"] = {"k": "v"}
    cache.put_child(changed)
    cache.drop_child(child("b"))
    assert names(cache) == {"a"}
    assert cache.children(KEY)[0]["data"] == {"k": "v"}
    assert "managedFields" not in cache.children(KEY)[0]["metadata"]
    cache.drop_pool(pool())
    assert cache.pool(KEY) is None and cache.children(KEY) == [] and len(cache) == 0


def test_a_cached_pod_keeps_what_says_why_it_is_not_ready_and_drops_its_spec() -> None:
    cache = ClusterCache()
    cache.put_child(crashing_pod())
    [cached] = cache.children(KEY)
    assert "spec" not in cached and "podIP" not in cached["status"]
    assert pod_trouble(cached) == pod_trouble(crashing_pod())
    trouble = pod_trouble(cached)
    assert trouble is not None and trouble.reason == "CrashLooping"
    assert "restarted 7 times" in trouble.detail


def test_a_fresh_read_drops_a_child_deleted_before_the_watch_listed() -> None:
    """Primed from a read, then the child is deleted before the watch starts: no event
    ever says so, and the next fresh read must drop it."""
    cache = ClusterCache()
    cache.replace([pool()], [child("a"), child("ghost")], cache.mark())
    assert names(cache) == {"a", "ghost"}
    cache.replace([pool()], [child("a")], cache.mark())
    assert names(cache) == {"a"}


def test_a_fresh_read_keeps_what_the_watches_wrote_while_it_ran() -> None:
    cache = ClusterCache()
    cache.replace([pool()], [child("a"), child("b"), child("c")], cache.mark())
    since = cache.mark()  # the read begins
    cache.put_child(child("new"))  # created after the read listed its kind
    changed = child("a")
    changed["data"] = {"edited": "after the read"}
    cache.put_child(changed)
    cache.drop_child(child("b"))  # deleted after the read listed it
    cache.replace([pool()], [child("a"), child("b"), child("c")], since)
    assert names(cache) == {"a", "c", "new"}
    edited = next(obj for obj in cache.children(KEY) if obj["metadata"]["name"] == "a")
    assert edited["data"] == {"edited": "after the read"}


def test_a_fresh_read_never_brings_back_a_pool_deleted_while_it_ran() -> None:
    cache = ClusterCache()
    cache.replace([pool()], [child("a")], cache.mark())
    since = cache.mark()
    cache.drop_pool(pool())
    cache.replace([pool()], [child("a")], since)
    assert cache.pool(KEY) is None


def test_a_pool_replaced_under_the_same_name_survives_the_old_ones_deletion() -> None:
    cache = ClusterCache()
    cache.put_pool(pool("old"))
    cache.put_pool(pool("new"))
    cache.put_child(child("a"))
    cache.drop_pool(pool("old"))  # the watch's late news of the first pool
    found = cache.pool(KEY)
    assert found is not None and found["metadata"]["uid"] == "new"
    assert names(cache) == {"a"}


def test_the_operator_uses_no_kopf_index() -> None:
    """kopf's indexes hold every handler until every indexed object is indexed, waking
    all waiting handlers per object: an operator restarted over thousands of pools
    resumed none for many minutes. The cache replaces them; keep it that way."""
    assert callable(handlers.cache)  # importing the module registers its handlers
    assert not kopf.get_default_registry()._indexing.get_all_selectors()
