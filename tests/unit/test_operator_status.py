"""A ServingPool's status from its Deployments (status.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pdserve.operator import api
from pdserve.operator.controller import status

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
LATER = NOW + timedelta(minutes=5)

Obj = dict[str, Any]


def spec(**overrides: Any) -> api.ServingPoolSpec:
    base: Obj = {
        "model": {"name": "m", "path": "/models/m"},
        "image": "pdserve:test",
        "decode": {"replicas": 2},
    }
    base.update(overrides)
    return api.parse_spec(base)


def deployment(
    name: str,
    replicas: int,
    *,
    ready: int | None = None,
    updated: int | None = None,
    generation: int = 1,
    observed: int = 1,
    conditions: list[Obj] | None = None,
) -> Obj:
    ready = replicas if ready is None else ready
    return {
        "metadata": {"name": name, "generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": ready,
            "conditions": conditions or [],
        },
    }


def healthy(pool: str = "p", decode: int = 2) -> dict[str, Obj]:
    return {
        f"{pool}-decode": deployment(f"{pool}-decode", decode),
        f"{pool}-router": deployment(f"{pool}-router", 1),
    }


def compute(
    deployments: dict[str, Obj],
    previous: api.ServingPoolStatus | None = None,
    the_spec: api.ServingPoolSpec | None = None,
    **kwargs: Any,
) -> api.ServingPoolStatus:
    return status.pool_status(
        previous or api.ServingPoolStatus(),
        pool="p",
        namespace="ns",
        generation=kwargs.pop("generation", 3),
        spec=the_spec or spec(),
        deployments=deployments,
        now=kwargs.pop("now", NOW),
        **kwargs,
    )


def conditions(s: api.ServingPoolStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in s.conditions}


def test_all_replicas_ready_is_ready() -> None:
    s = compute(healthy())
    assert s.phase == "Ready"
    assert conditions(s) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert s.decode == api.RoleStatus(desired_replicas=2, ready_replicas=2)
    assert s.decode is not None and s.decode.summary == "2/2"
    assert s.prefill is None  # no prefill pool
    assert s.observed_generation == 3
    assert s.router_endpoint == "http://p-router.ns.svc:8000"
    assert all(c.observed_generation == 3 for c in s.conditions)


def test_no_decode_worker_ready_is_pending_some_is_progressing() -> None:
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 2, ready=0)
    assert compute(deployments).phase == "Pending"
    deployments["p-decode"] = deployment("p-decode", 2, ready=1)
    s = compute(deployments)
    assert s.phase == "Progressing"
    assert conditions(s)["Ready"] == ("False", "ReplicasNotReady")
    assert conditions(s)["Progressing"] == ("True", "RollingOut")
    assert s.decode is not None and s.decode.summary == "1/2"
    assert compute({}).phase == "Pending"  # nothing created yet


def test_a_rollout_waits_for_the_generation_the_operator_wrote() -> None:
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 2, generation=5, observed=4)
    assert compute(deployments, written={"p-decode": 5}).phase == "Progressing"
    # A generation bumped by someone else (Deployments count annotation edits) does not.
    assert compute(deployments, written={"p-decode": 4}).phase == "Ready"


def test_old_pods_still_running_are_not_ready_replicas() -> None:
    deployments = healthy()
    surge = deployment("p-decode", 2, ready=3, updated=1)
    surge["status"]["replicas"] = 3
    deployments["p-decode"] = surge
    s = compute(deployments)
    assert s.phase == "Progressing"
    assert s.decode is not None and s.decode.ready_replicas == 1


def test_a_refused_write_or_a_stuck_deployment_is_degraded() -> None:
    s = compute(healthy(), failure="422 Invalid: spec.selector: field is immutable")
    assert s.phase == "Degraded"
    assert conditions(s)["Degraded"] == ("True", "ApplyFailed")
    degraded = s.condition("Degraded")
    assert degraded is not None and "immutable" in degraded.message

    stuck = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 2, ready=0, conditions=[stuck])
    s = compute(deployments)
    assert s.phase == "Degraded"
    assert conditions(s)["Degraded"] == ("True", "DeploymentStuck")


def test_transition_times_move_only_when_a_condition_flips() -> None:
    first = compute(healthy())
    again = compute(healthy(), previous=first, now=LATER)
    assert [c.last_transition_time for c in again.conditions] == [NOW, NOW, NOW]
    assert status.status_change(api.dump(first), again) is None

    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 2, ready=1)
    flipped = compute(deployments, previous=first, now=LATER)
    times = {c.type: c.last_transition_time for c in flipped.conditions}
    assert times == {"Ready": LATER, "Progressing": LATER, "Degraded": NOW}


def test_prefill_and_router_follow_the_spec() -> None:
    disaggregated = spec(
        prefill={"replicas": 1},
        routing={
            "buckets": [{"maxInputTokens": 512, "mode": "colocated"}, {"mode": "disaggregated"}]
        },
        router={"replicas": 0},
    )
    deployments = {"p-decode": deployment("p-decode", 2), "p-prefill": deployment("p-prefill", 1)}
    s = compute(deployments, the_spec=disaggregated)
    assert s.phase == "Ready"
    assert s.prefill is not None and s.prefill.summary == "1/1"
    assert s.router is not None and s.router.desired_replicas == 0
    assert s.router_endpoint is None


def test_a_status_change_drops_what_the_new_status_lacks() -> None:
    old = api.dump(compute(healthy()))
    without_router = compute(
        {"p-decode": deployment("p-decode", 2)}, the_spec=spec(router={"replicas": 0})
    )
    wanted = status.status_change(old, without_router)
    assert wanted is not None
    assert "routerEndpoint" in old and "routerEndpoint" not in wanted
    assert wanted["router"] == {"desiredReplicas": 0, "readyReplicas": 0, "summary": "0/0"}


def test_status_survives_a_round_trip_through_the_api() -> None:
    s = compute(healthy())
    dumped = api.dump(s)
    assert dumped["conditions"][0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert status.previous_status(dumped) == s
    assert status.previous_status({"phase": "Bogus"}) == api.ServingPoolStatus()
    assert status.previous_status(None) == api.ServingPoolStatus()


def test_an_invalid_spec_fails_the_pool_and_keeps_its_counts() -> None:
    before = compute(healthy())
    s = status.invalid_status(
        before, generation=4, errors=["spec.decode.replicas: too many"], now=LATER
    )
    assert s.phase == "Failed"
    assert s.observed_generation == 4
    assert conditions(s) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    degraded = s.condition("Degraded")
    assert degraded is not None and degraded.message == "spec.decode.replicas: too many"
    assert s.decode == before.decode


# --- why replicas are not ready --------------------------------------------------------


def pod(component: str, status: Obj, **meta: Any) -> Obj:
    labels = {"app.kubernetes.io/component": component}
    return {"kind": "Pod", "metadata": {"name": f"{component}-x", "labels": labels, **meta},
            "status": status}  # fmt: skip


def unschedulable(message: str) -> Obj:
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": message}  # fmt: skip
    return {"phase": "Pending", "conditions": [condition]}


def waiting(reason: str, message: str = "", **container: Any) -> Obj:
    state = {"waiting": {"reason": reason, "message": message}}
    return {"phase": "Pending", "containerStatuses": [
        {"name": "decode", "image": "pdserve:0.1.0", "state": state, **container}
    ]}  # fmt: skip


NO_CLAIM = '0/1 nodes are available: persistentvolumeclaim "models" not found.'
NO_GPU = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."


def test_ready_names_the_schedulers_reason() -> None:
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 2, ready=0)
    pods = [pod("decode", unschedulable(NO_CLAIM)), pod("decode", unschedulable(NO_CLAIM))]
    s = compute(deployments, pods=pods)
    ready = s.condition("Ready")
    assert ready is not None and (ready.status, ready.reason) == ("False", "Unschedulable")
    assert (
        ready.message == f"decode 0/2, router 1/1 ready: decode: 2 pods Unschedulable ({NO_CLAIM})"
    )
    assert s.phase == "Pending"


@pytest.mark.parametrize(
    ("pod_status", "reason", "words"),
    [
        (waiting("ImagePullBackOff", 'Back-off pulling image "pdserve:0.1.0"'), "ImagePullFailed",
         'pdserve:0.1.0: ImagePullBackOff: Back-off pulling image "pdserve:0.1.0"'),
        (waiting("ErrImagePull", "not found"), "ImagePullFailed",
         "pdserve:0.1.0: ErrImagePull: not found"),
        (waiting("CrashLoopBackOff", restartCount=5,
                 lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}}),
         "CrashLooping", "container decode restarted 5 times; last exit: OOMKilled (code 137)"),
        (waiting("CreateContainerConfigError", 'secret "hf" not found'), "ContainerCreateFailed",
         'CreateContainerConfigError: secret "hf" not found'),
    ],
)  # fmt: skip
def test_ready_names_what_the_kubelet_says(pod_status: Obj, reason: str, words: str) -> None:
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 2, ready=1)
    s = compute(deployments, pods=[pod("decode", pod_status)])
    ready = s.condition("Ready")
    assert ready is not None and ready.reason == reason
    assert f"decode: 1 pod {reason} ({words})" in ready.message


def test_the_cause_to_fix_first_leads() -> None:
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 3, ready=0)
    pods = [
        pod("decode", waiting("CrashLoopBackOff")),
        pod("decode", unschedulable(NO_GPU)),
        pod("decode", {"phase": "Pending"}),  # just starting: no trouble
        pod("decode", unschedulable(NO_GPU), deletionTimestamp="2026-01-01T00:00:00Z"),
    ]
    ready = compute(deployments, pods=pods).condition("Ready")
    assert ready is not None and ready.reason == "Unschedulable"
    assert ready.message.endswith(
        f"decode: 1 pod Unschedulable ({NO_GPU}); decode: 1 pod CrashLooping "
        "(container decode restarted 0 times)"
    )


def test_pods_of_ready_components_are_not_blamed() -> None:
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 2, ready=1)
    pods = [pod("router", waiting("CrashLoopBackOff"))]  # the router has its replica
    ready = compute(deployments, pods=pods).condition("Ready")
    assert ready is not None and ready.reason == "ReplicasNotReady"
    assert compute(healthy(), pods=pods).phase == "Ready"


# --- the autoscaler's part ----------------------------------------------------------------


def test_the_autoscalers_conditions_are_set_kept_and_removed() -> None:
    scaling = status.ScalingReport(
        {
            "ScalingActive": status.Verdict("False", "NoMetrics", "no series"),
            "DisaggregationActive": status.Verdict("Unknown", "NoMetrics", "no series"),
        },
        api.AutoscalingStatus(decode=api.RoleScalingStatus(replicas=3, reason="ITLAboveTarget")),
    )
    reported = status.with_scaling(compute(healthy()), scaling, now=LATER)
    assert conditions(reported)["ScalingActive"] == ("False", "NoMetrics")
    # A reconcile's status keeps what the autoscaler wrote.
    again = compute(healthy(), previous=reported, now=LATER)
    assert conditions(again)["DisaggregationActive"] == ("Unknown", "NoMetrics")
    assert again.autoscaling == scaling.autoscaling
    cleared = status.with_scaling(again, status.ScalingReport({}, None))
    assert set(conditions(cleared)) == {"Ready", "Progressing", "Degraded"}
    assert cleared.autoscaling is None


def test_planned_replicas_are_the_desired_ones() -> None:
    autoscaled = spec(
        slo={"itl": {"seconds": 0.05}},
        autoscaling={"enabled": True, "decode": {"minReplicas": 1, "maxReplicas": 5}},
    )
    deployments = healthy()
    deployments["p-decode"] = deployment("p-decode", 4, ready=2)
    s = compute(deployments, the_spec=autoscaled, replicas={"decode": 4})
    assert s.decode is not None and s.decode.summary == "2/4"
