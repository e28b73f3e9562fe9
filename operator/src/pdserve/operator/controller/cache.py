"""What the operator knows of its pools and their children between reads.

The watches feed it (every event, the initial listings included), and one read of
every pool and child primes it before the watches start, so that a pool resumed at
start-up is reconciled against all of its children, not the part the watches have
delivered so far: deciding that nothing needs writing then costs no request.

Why not kopf's indexes, which do the same: kopf holds every object's handlers until
every object of every indexed kind is indexed, and each object it meets while the
operator starts wakes every handler already waiting. That is quadratic in the objects
watched: an operator restarted over 2,000 pools (some 30,000 children) had not resumed
one of them after ten minutes.

A listing never reports what was deleted before it, so a child deleted between the
priming read and the watch's own listing would stay here. The periodic resync's fresh
read replaces the cache (keeping whatever the watches wrote since that read began): such
a ghost lives one resync interval at most, and the resync itself works from its read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.operator import render

Obj = dict[str, Any]
PoolKey = tuple[str, str]  # (namespace, pool name)

# What the operator reads of a pod (status.py: why replicas are not ready); a pod's
# spec is most of its size and is never read.
POD_STATUS_FIELDS = ("phase", "conditions", "initContainerStatuses", "containerStatuses")


def cached_copy(body: Mapping[str, Any]) -> Obj:
    """An object as the cache keeps it: without managedFields (large, and never read),
    and a pod without its spec.

    Shallow: nested values are shared with the watch's copy, which nobody modifies (the
    reconciler builds new objects, and every event brings a new body).
    """
    meta = body["metadata"]
    copy = {**body, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    if body.get("kind") == "Pod":
        copy.pop("spec", None)
        status = body.get("status") or {}
        copy["status"] = {k: status[k] for k in POD_STATUS_FIELDS if k in status}
    return copy


def pool_key(pool: Mapping[str, Any]) -> PoolKey:
    """A pool's (namespace, name)."""
    return pool["metadata"]["namespace"], pool["metadata"]["name"]


def pool_of_child(child: Mapping[str, Any]) -> PoolKey:
    """The (namespace, name) of the pool a child is labelled with."""
    meta = child["metadata"]
    return meta.get("namespace", ""), meta["labels"][render.POOL_LABEL]


@dataclass
class _Entry:
    obj: Obj
    written: int  # the cache's write count when it was stored


class ClusterCache:
    """Every pool by (namespace, name), and every child by its pool and uid."""

    def __init__(self) -> None:
        self._pools: dict[PoolKey, _Entry] = {}
        self._children: dict[PoolKey, dict[str, _Entry]] = {}
        # Objects the watches saw deleted since the last fresh read (uid: write count):
        # a read begun before the deletion still lists them.
        self._deleted: dict[str, int] = {}
        self._writes = itertools.count(1)
        self._last = 0

    def mark(self) -> int:
        """A point in the cache's history: pass it to `replace` after a read that
        began now, so that what the watches write meanwhile is kept."""
        return self._last

    def _tick(self) -> int:
        self._last = next(self._writes)
        return self._last

    # --- the watches ---------------------------------------------------------------

    def put_pool(self, pool: Mapping[str, Any]) -> Obj:
        """A pool as a watch event brought it; returns the copy kept."""
        kept = cached_copy(pool)
        self._pools[pool_key(pool)] = _Entry(kept, self._tick())
        return kept

    def drop_pool(self, pool: Mapping[str, Any]) -> None:
        """A deleted pool, and its children (garbage collection deletes them next)."""
        key = pool_key(pool)
        entry = self._pools.get(key)
        if entry is not None and entry.obj["metadata"]["uid"] != pool["metadata"]["uid"]:
            return  # a newer pool of the same name is already here
        self._deleted[pool["metadata"]["uid"]] = self._tick()
        self._pools.pop(key, None)
        self._children.pop(key, None)

    def put_child(self, child: Mapping[str, Any]) -> None:
        """A child as a watch event brought it."""
        found = self._children.setdefault(pool_of_child(child), {})
        found[child["metadata"]["uid"]] = _Entry(cached_copy(child), self._tick())

    def drop_child(self, child: Mapping[str, Any]) -> None:
        """A deleted child."""
        self._deleted[child["metadata"]["uid"]] = self._tick()
        key = pool_of_child(child)
        found = self._children.get(key)
        if found is not None:
            found.pop(child["metadata"]["uid"], None)
            if not found:
                del self._children[key]

    # --- reads ---------------------------------------------------------------------

    def pool(self, key: PoolKey) -> Obj | None:
        """The pool, if the cache knows it."""
        entry = self._pools.get(key)
        return None if entry is None else entry.obj

    def children(self, key: PoolKey) -> list[Obj]:
        """The pool's children the cache knows."""
        return [entry.obj for entry in self._children.get(key, {}).values()]

    def __len__(self) -> int:
        """How many objects the cache holds (pools and children)."""
        return len(self._pools) + sum(len(found) for found in self._children.values())

    # --- a fresh read of everything --------------------------------------------------

    def replace(self, pools: Iterable[Obj], children: Iterable[Obj], since: int) -> None:
        """Take a fresh read of every pool and child, begun at `mark()` == `since`:
        what it lists replaces the cache, except what the watches wrote after it began
        (newer than the read); what it does not list is dropped, likewise."""
        deleted = {uid for uid, written in self._deleted.items() if written > since}
        self._deleted.clear()  # the next read begins after every deletion seen so far
        fresh_pools = {
            pool_key(pool): pool for pool in pools if pool["metadata"]["uid"] not in deleted
        }
        for key in [k for k, e in self._pools.items() if e.written <= since]:
            if key not in fresh_pools:
                del self._pools[key]
        for key, pool in fresh_pools.items():
            entry = self._pools.get(key)
            if entry is None or entry.written <= since:
                self._pools[key] = _Entry(cached_copy(pool), since)
        fresh: dict[PoolKey, dict[str, Obj]] = {}
        for child in children:
            if child["metadata"]["uid"] in deleted:
                continue
            fresh.setdefault(pool_of_child(child), {})[child["metadata"]["uid"]] = child
        for key in set(self._children) | set(fresh):
            self._replace_children(key, fresh.get(key, {}), since)

    def _replace_children(self, key: PoolKey, listed: Mapping[str, Obj], since: int) -> None:
        known = self._children.get(key, {})
        kept = {uid: e for uid, e in known.items() if e.written > since}
        for uid, child in listed.items():
            kept.setdefault(uid, _Entry(cached_copy(child), since))
        if kept:
            self._children[key] = kept
        else:
            self._children.pop(key, None)
