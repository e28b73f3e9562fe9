"""A ServingPool's status from what its Deployments report (pure).

Conditions:
  Ready        every component has its desired replicas, updated and ready
  Progressing  a rollout or scale is under way
  Degraded     something needs a person: an invalid spec, a refused apply, a
               Deployment that cannot make progress (deadline exceeded, pods refused)
The phase sums them up for `kubectl get sp`: Failed (invalid spec), Degraded, Ready,
Pending (no decode worker ready: the pool cannot answer yet) or Progressing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from pdserve.operator import api, render

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Rollout:
    """How far one component's Deployment is."""

    desired: int
    ready: int
    settled: bool  # the Deployment runs exactly `desired` ready pods of its latest template
    problem: str | None = None  # why it cannot progress, if it says so


def rollout(deployment: Obj | None, desired: int, written: int = 0) -> Rollout:
    """The rollout of a component from its live Deployment (None: not there yet).

    `written` is the generation of the operator's last write of it: the rollout is
    not settled before the Deployment controller has seen that one. Later
    generations bumped by others (Deployments count annotation edits too) do not
    hold the pool back: the replica counts still tell a rollout of theirs.
    """
    if desired == 0:
        return Rollout(0, 0, settled=deployment is None)
    if deployment is None:
        return Rollout(desired, 0, settled=False)
    spec, status = deployment["spec"], deployment.get("status", {})
    observed = status.get("observedGeneration", 0) >= written
    ready = min(status.get("readyReplicas", 0), status.get("updatedReplicas", 0))
    settled = (
        observed
        and spec.get("replicas") == desired
        and status.get("replicas", 0) == desired
        and status.get("updatedReplicas", 0) == desired
        and status.get("readyReplicas", 0) >= desired
    )
    name = deployment["metadata"]["name"]
    return Rollout(desired, min(ready, desired), settled, _problem(name, status))


def _problem(name: str, status: Obj) -> str | None:
    for condition in status.get("conditions", []):
        stuck = condition.get("type") == "Progressing" and condition.get("status") == "False"
        refused = condition.get("type") == "ReplicaFailure" and condition.get("status") == "True"
        if stuck or refused:
            return f"Deployment {name}: {condition.get('reason')}: {condition.get('message', '')}"
    return None


def rollouts(
    pool: str,
    spec: api.ServingPoolSpec,
    deployments: Mapping[str, Obj],
    written: Mapping[str, int] | None = None,
) -> dict[render.Component, Rollout]:
    """The rollout of every component, keyed prefill/decode/router; `written` maps
    Deployment names to the generation of the operator's last write."""
    counts = render.desired_replicas(spec)
    out = {}
    for component, desired in counts.items():
        name = render.object_name(pool, component)
        out[component] = rollout(deployments.get(name), desired, (written or {}).get(name, 0))
    return out


def previous_status(raw: Mapping[str, Any] | None) -> api.ServingPoolStatus:
    """The status a pool carries (an unreadable one counts as empty)."""
    try:
        return api.ServingPoolStatus.model_validate(raw or {}, by_name=False)
    except ValidationError:
        return api.ServingPoolStatus()


def _role(rollout: Rollout) -> api.RoleStatus:
    return api.RoleStatus(desired_replicas=rollout.desired, ready_replicas=rollout.ready)


def _summary(components: Mapping[render.Component, Rollout]) -> str:
    parts = [f"{c} {r.ready}/{r.desired}" for c, r in components.items() if r.desired]
    return ", ".join(parts) + " ready" if parts else "no replicas requested"


def pool_status(
    previous: api.ServingPoolStatus,
    *,
    pool: str,
    namespace: str,
    generation: int | None,
    spec: api.ServingPoolSpec,
    deployments: Mapping[str, Obj],
    written: Mapping[str, int] | None = None,
    failure: str | None = None,
    now: datetime | None = None,
) -> api.ServingPoolStatus:
    """The status after applying `spec` (generation `generation`); `written` as for
    rollouts(); `failure` says why the last apply failed, if it did."""
    components = rollouts(pool, spec, deployments, written)
    ready = all(r.settled for r in components.values())
    problems = [r.problem for r in components.values() if r.problem]
    summary = _summary(components)
    conditions = previous.conditions

    def put(type_: api.ConditionType, status: bool, reason: str, message: str) -> None:
        nonlocal conditions
        flag: api.ConditionStatus = "True" if status else "False"
        conditions = api.with_condition(
            conditions, type_, flag, reason, message, generation=generation, now=now
        )

    put("Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady", summary)
    put("Progressing", not ready, "RollingOut" if not ready else "RolloutComplete", summary)
    if failure is not None:
        put("Degraded", True, "ApplyFailed", failure)
    elif problems:
        put("Degraded", True, "DeploymentStuck", "; ".join(problems))
    else:
        put("Degraded", False, "AsExpected", "")
    if failure is not None or problems:
        phase: api.Phase = "Degraded"
    elif ready:
        phase = "Ready"
    elif components["decode"].desired and not components["decode"].ready:
        phase = "Pending"  # no decode worker yet: the pool cannot answer anything
    else:
        phase = "Progressing"
    return api.ServingPoolStatus(
        observed_generation=generation,
        phase=phase,
        conditions=conditions,
        prefill=_role(components["prefill"]) if spec.prefill is not None else None,
        decode=_role(components["decode"]),
        router=_role(components["router"]),
        router_endpoint=render.router_endpoint(pool, namespace) if spec.router.replicas else None,
    )


def invalid_status(
    previous: api.ServingPoolStatus,
    *,
    generation: int | None,
    errors: Sequence[str],
    now: datetime | None = None,
) -> api.ServingPoolStatus:
    """The status of a pool whose spec the operator refuses (replica counts kept)."""
    message = "; ".join(errors)
    conditions = previous.conditions
    refused: tuple[tuple[api.ConditionType, api.ConditionStatus], ...] = (
        ("Ready", "False"),
        ("Progressing", "False"),
        ("Degraded", "True"),
    )
    for type_, flag in refused:
        conditions = api.with_condition(
            conditions, type_, flag, "InvalidSpec", message, generation=generation, now=now
        )
    return previous.model_copy(
        update={"observed_generation": generation, "phase": "Failed", "conditions": conditions}
    )


def status_patch(old: Mapping[str, Any], new: api.ServingPoolStatus) -> dict[str, Any] | None:
    """The merge patch taking status `old` to `new` (None: nothing to change).

    Keys of `old` that `new` lacks are set to null, which a merge patch removes.
    """
    wanted = api.dump(new)
    if wanted == dict(old):
        return None
    return {**{key: None for key in old if key not in wanted}, **wanted}
