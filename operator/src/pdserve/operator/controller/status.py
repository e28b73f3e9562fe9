"""A ServingPool's status from what its Deployments and pods report (pure).

Conditions:
  Ready        every component has its desired replicas, updated and ready; when
               not, the reason and message name what the pods say keeps them (the
               scheduler's reason, image pulls, crash loops)
  Progressing  a rollout or scale is under way
  Degraded     something needs a person: an invalid spec, a refused apply, a
               Deployment that cannot make progress (deadline exceeded, pods refused),
               a Secret holding the name of the pool's credential that the operator
               did not create (SecretConflict)
  ScalingActive, DisaggregationActive
               written by the autoscaler (scaling/autoscaler.py), kept as they are here
The phase sums them up for `kubectl get sp`: Failed (invalid spec), Degraded, Ready,
Pending (no decode worker ready: the pool cannot answer yet) or Progressing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
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
        gone = deployment is None or not deployment.get("status", {}).get("replicas")
        return Rollout(0, 0, settled=gone)
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


def combined(parts: Sequence[Rollout]) -> Rollout:
    """The rollout of a role run by several Deployments (one per revision)."""
    problems = [part.problem for part in parts if part.problem]
    return Rollout(
        desired=sum(part.desired for part in parts),
        ready=sum(part.ready for part in parts),
        settled=all(part.settled for part in parts),
        problem=problems[0] if problems else None,
    )


def rollouts(
    pool: str,
    spec: api.ServingPoolSpec,
    deployments: Mapping[str, Obj],
    written: Mapping[str, int] | None = None,
    replicas: Mapping[api.Role, int] | None = None,
    expected: Mapping[api.Role, Mapping[str, int | None]] | None = None,
) -> dict[render.Component, Rollout]:
    """The rollout of every component, keyed prefill/decode/router; `written` maps
    Deployment names to the generation of the operator's last write, `replicas` are
    the planner's counts. Workers an HPA or KEDA scales want what their Deployment says.
    `expected` names a role's rendered Deployments and their counts, where they are
    not `<pool>-<role>` alone (a canary role: one per revision)."""
    counts = render.desired_replicas(spec, replicas)
    out = {}
    for component, desired in counts.items():
        named = (expected or {}).get(component) if component != "router" else None
        if named:
            out[component] = combined([
                rollout(
                    deployments.get(name),
                    deployments.get(name, {}).get("spec", {}).get("replicas", 0)
                    if count is None else count,
                    (written or {}).get(name, 0),
                )
                for name, count in named.items()
            ])  # fmt: skip
            continue
        name = render.object_name(pool, component)
        deployment = deployments.get(name)
        if component != "router" and deployment is not None and render.externally_scaled(spec):
            desired = deployment["spec"].get("replicas", desired)
        out[component] = rollout(deployment, desired, (written or {}).get(name, 0))
    return out


# --- why pods are not ready -------------------------------------------------------------

IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
CREATE = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
# The order causes are named in: the one a person must fix first comes first.
CAUSES = ("Unschedulable", "ImagePullFailed", "CrashLooping", "ContainerCreateFailed")


@dataclass(frozen=True)
class PodTrouble:
    """What keeps one pod from being ready."""

    component: str
    reason: str  # one of CAUSES
    detail: str  # the scheduler's or the kubelet's words


def _terminated(container: Obj) -> str:
    last = container.get("lastState", {}).get("terminated") or {}
    if not last:
        return ""
    return f"; last exit: {last.get('reason', 'Error')} (code {last.get('exitCode', '?')})"


def pod_trouble(pod: Obj) -> PodTrouble | None:
    """Why a pod is not ready, when it says why (None: starting, or fine)."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    if meta.get("deletionTimestamp"):
        return None
    component = meta.get("labels", {}).get("app.kubernetes.io/component", "?")
    for condition in status.get("conditions", []):
        refused = (condition.get("type"), condition.get("reason")) == (
            "PodScheduled", "Unschedulable",
        )  # fmt: skip
        if refused and condition.get("status") == "False":
            return PodTrouble(component, "Unschedulable", condition.get("message", ""))
    containers = [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]
    for container in containers:
        waiting = container.get("state", {}).get("waiting") or {}
        reason, message = waiting.get("reason", ""), waiting.get("message", "")
        if reason in IMAGE_PULL:
            detail = f"{container.get('image', '?')}: {reason}" + (
                f": {message}" if message else ""
            )
            return PodTrouble(component, "ImagePullFailed", detail)
        if reason == "CrashLoopBackOff":
            restarts = container.get("restartCount", 0)
            detail = f"container {container.get('name')} restarted {restarts} times"
            return PodTrouble(component, "CrashLooping", detail + _terminated(container))
        if reason in CREATE:
            return PodTrouble(component, "ContainerCreateFailed", f"{reason}: {message}")
    return None


def pod_troubles(pods: Iterable[Obj], components: Iterable[str]) -> list[PodTrouble]:
    """The troubles of the pods of `components`, in the order of CAUSES."""
    wanted = set(components)
    found = [t for pod in pods if (t := pod_trouble(pod)) is not None and t.component in wanted]
    return sorted(found, key=lambda t: (CAUSES.index(t.reason), t.component))


def describe_troubles(troubles: Sequence[PodTrouble]) -> str:
    """ "decode: 4 pods Unschedulable (0/1 nodes are available: ...)" per distinct cause."""
    counts = Counter((t.component, t.reason, t.detail) for t in troubles)
    parts = []
    for (component, reason, detail), count in counts.items():
        pods = "1 pod" if count == 1 else f"{count} pods"
        parts.append(f"{component}: {pods} {reason}" + (f" ({detail})" if detail else ""))
    return "; ".join(parts)


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
    pods: Iterable[Obj] = (),
    replicas: Mapping[api.Role, int] | None = None,
    credential: api.CreatedSecret | None = None,
    conflict: str | None = None,
    expected: Mapping[api.Role, Mapping[str, int | None]] | None = None,
) -> api.ServingPoolStatus:
    """The status after applying `spec` (generation `generation`); `written` and
    `replicas` as for rollouts(); `failure` says why the last apply failed, if it did;
    `pods` tell why replicas are not ready; `credential` is the credential Secret the
    operator made (None: the one recorded stays), `conflict` why a Secret of its name
    is not the pool's; `expected` as for rollouts(). The rollouts are kept as they were."""
    components = rollouts(pool, spec, deployments, written, replicas, expected)
    ready = all(r.settled for r in components.values())
    problems = [r.problem for r in components.values() if r.problem]
    summary = _summary(components)
    unready = [c for c, r in components.items() if r.ready < r.desired]
    troubles = pod_troubles(pods, unready) if not ready else []
    conditions = previous.conditions

    def put(type_: api.ConditionType, status: bool, reason: str, message: str) -> None:
        nonlocal conditions
        flag: api.ConditionStatus = "True" if status else "False"
        conditions = api.with_condition(
            conditions, type_, flag, reason, message, generation=generation, now=now
        )

    if troubles:
        put("Ready", False, troubles[0].reason, f"{summary}: {describe_troubles(troubles)}")
    else:
        put("Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady", summary)
    put("Progressing", not ready, "RollingOut" if not ready else "RolloutComplete", summary)
    if conflict is not None:
        put("Degraded", True, "SecretConflict", failure or conflict)
    elif failure is not None:
        put("Degraded", True, "ApplyFailed", failure)
    elif problems:
        put("Degraded", True, "DeploymentStuck", "; ".join(problems))
    else:
        put("Degraded", False, "AsExpected", "")
    if failure is not None or conflict is not None or problems:
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
        credential_secret=credential or previous.credential_secret,
        autoscaling=previous.autoscaling,
        rollout=previous.rollout,
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


def status_change(old: Mapping[str, Any], new: api.ServingPoolStatus) -> dict[str, Any] | None:
    """The status to write in place of `old` (None: nothing to change). It replaces the
    whole status: keys of `old` that `new` lacks go."""
    wanted = api.dump(new)
    return None if wanted == dict(old) else wanted


# --- what the autoscaler writes ---------------------------------------------------------

# The conditions the autoscaler owns.
SCALING_CONDITIONS: tuple[api.ConditionType, ...] = ("ScalingActive", "DisaggregationActive")


@dataclass(frozen=True)
class Verdict:
    """A condition's status, reason and message."""

    status: api.ConditionStatus
    reason: str
    message: str


@dataclass(frozen=True)
class ScalingReport:
    """What the autoscaler found: its conditions (absent: removed) and its last
    decision (None: removed)."""

    conditions: Mapping[api.ConditionType, Verdict]
    autoscaling: api.AutoscalingStatus | None


def with_scaling(
    previous: api.ServingPoolStatus, report: ScalingReport, now: datetime | None = None
) -> api.ServingPoolStatus:
    """The status with the autoscaler's conditions and decision replaced."""
    conditions = previous.conditions
    for type_ in SCALING_CONDITIONS:
        verdict = report.conditions.get(type_)
        if verdict is None:
            conditions = api.without_condition(conditions, type_)
        else:
            conditions = api.with_condition(
                conditions, type_, verdict.status, verdict.reason, verdict.message,
                generation=previous.observed_generation, now=now,
            )  # fmt: skip
    return previous.model_copy(update={"conditions": conditions, "autoscaling": report.autoscaling})
