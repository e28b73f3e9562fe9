"""Handing a role's workers over from one Deployment to another without an outage
(pure).

A worker Deployment that is no longer rendered is normally deleted at once (its pods
drain: their grace period covers the pool's `drainSeconds`). When its pods still
serve the role's requests, deleting it before its successors are ready would leave
the role short of workers: a completed rollout (the old stable revision, while the
new one grows from its last step to every worker), a role switched between the
replace and canary strategies (`<pool>-<role>` and `<pool>-<revision>`). Such a
Deployment is kept until every Deployment rendered for its role has its replicas
ready. Kept only while the role's requests are not split by revision: a canary a
rollout replaced, rolled back or aborted takes no requests, and goes at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.operator import api, render
from pdserve.operator.render import REVISION_LABEL

Obj = Mapping[str, Any]
COMPONENT_LABEL = "app.kubernetes.io/component"


def role_of(obj: Obj) -> api.Role | None:
    """The worker role of a Deployment (None: not a worker Deployment)."""
    if obj.get("kind") != "Deployment":
        return None
    component = obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)
    return next((role for role in api.ROLES if role == component), None)


def ready(live: Obj | None, desired: Obj) -> bool:
    """Whether a live Deployment runs the replicas its rendering asks for, ready and
    of its latest template."""
    if live is None:
        return False
    status = live.get("status", {})
    wanted = desired["spec"].get("replicas", live["spec"].get("replicas", 1))
    observed = status.get("observedGeneration", 0) >= live["metadata"].get("generation", 0)
    updated = min(status.get("readyReplicas", 0), status.get("updatedReplicas", 0))
    return bool(observed and updated >= wanted)


def refused(rollout: api.RoleRolloutStatus | None) -> str | None:
    """The canary revision a role's rollout rolled back or aborted (None: none)."""
    if rollout is None or rollout.phase not in ("RolledBack", "Aborted"):
        return None
    return rollout.canary_revision


def kept(
    departing: Obj,
    successors: Iterable[Obj],
    live: Mapping[str, Obj],
    *,
    split: bool,
    refused_revision: str | None,
) -> bool:
    """Whether a worker Deployment no longer rendered stays for now: its role's
    requests are not `split` by revision, it is not the `refused_revision`, and one of
    the role's rendered Deployments (`successors`) is not ready yet; `live` holds the
    live Deployments by name."""
    if role_of(departing) is None or split:
        return False
    revision = departing["metadata"].get("labels", {}).get(REVISION_LABEL)
    if revision is not None and revision == refused_revision:
        return False
    return not all(ready(live.get(d["metadata"]["name"]), d) for d in successors)


def kept_deployments(
    spec: api.ServingPoolSpec,
    rollout: api.RolloutStatus | None,
    desired: Iterable[Obj],
    live: Iterable[Obj],
) -> set[str]:
    """The names of the live worker Deployments that are not rendered but stay for
    now (see `kept`)."""
    rendered = [obj for obj in desired if role_of(obj) is not None]
    names = {obj["metadata"]["name"] for obj in rendered}
    deployments = {obj["metadata"]["name"]: obj for obj in live if role_of(obj) is not None}
    weights = render.revision_weights(spec, rollout)
    found = set()
    for name, obj in deployments.items():
        role = role_of(obj)
        if name in names or role is None:
            continue
        successors = [d for d in rendered if role_of(d) == role]
        status = rollout.role(role) if rollout is not None else None
        split, refused_revision = bool(weights.of(role)), refused(status)
        if kept(obj, successors, deployments, split=split, refused_revision=refused_revision):
            found.add(name)
    return found


def expected_counts(desired: Iterable[Obj]) -> dict[api.Role, dict[str, int | None]]:
    """Each canary role's rendered Deployments (one per revision) and their replicas
    (None: an autoscaler's); a replace role's `<pool>-<role>` is counted as ever."""
    counts: dict[api.Role, dict[str, int | None]] = {}
    for obj in desired:
        role = role_of(obj)
        if role is not None and REVISION_LABEL in obj["metadata"].get("labels", {}):
            counts.setdefault(role, {})[obj["metadata"]["name"]] = obj["spec"].get("replicas")
    return counts
