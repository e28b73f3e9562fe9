"""The operator against a real control plane: children, status, rollouts, repair, GC.

Each test runs `python -m pdserve operator` as a process of its own, watching only
the test's namespace, under the chart's ServiceAccount and RBAC (support.operator). kwok
plays the kubelet, so pods turn Ready without containers; the real
kube-controller-manager runs Deployments and garbage collection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.operator import api, render
from pdserve.operator.controller import drift
from support.operator import POOL_LABEL, Cluster, OperatorProcess, get_json, running, wait_until
from support.pool_cluster import (
    CHILD_KINDS,
    MONITORED,
    WAIT,
    Key,
    apply_pool,
    children,
    condition,
    event_reasons,
    get_pool,
    make_namespace,
    patch_pool,
    pool_manifest,
    resource_versions,
    settled_versions,
    versions,
    wait_ready,
    writes,
)

pytestmark = pytest.mark.cluster


def columns(table: str) -> list[dict[str, str]]:
    """`kubectl get` output as rows keyed by column name (empty cells stay empty)."""
    header, *rows = table.splitlines()
    names = header.split()
    starts = [header.index(name) for name in names]
    ends = [*starts[1:], None]
    return [
        {n: row[s:e].strip() for n, s, e in zip(names, starts, ends, strict=True)} for row in rows
    ]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return found


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- tests ---------------------------------------------------------------------------------


def test_pool_gets_its_children_and_turns_ready(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    manifest = pool_manifest(
        "llama",
        prefill={"replicas": 1, "gpus": 1, "engine": {"maxNumBatchedTokens": 2048}},
        decode={"replicas": 1, "gpus": 1, "engine": {"maxNumBatchedTokens": 256}},
        routing={
            "buckets": [{"maxInputTokens": 512, "mode": "colocated"}, {"mode": "disaggregated"}]
        },
    )
    apply_pool(cluster, namespace, manifest)
    pool = wait_ready(cluster, namespace, "llama")

    # Every rendered object exists, holds what was rendered, and is owned by the pool.
    live = children(cluster, namespace, "llama")
    spec = api.parse_spec(pool["spec"])
    rendered = {
        (o["kind"], o["metadata"]["name"]): o for o in render.render("llama", namespace, spec)
    }
    assert set(live) == set(rendered)
    assert {kind for kind, _ in live} == {
        "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Service", "Deployment",
        "PodDisruptionBudget", "NetworkPolicy",
    }  # fmt: skip
    for key, want in rendered.items():
        assert drift.holds(live[key], want), f"{key} differs from its rendering"
        (owner,) = live[key]["metadata"]["ownerReferences"]
        assert owner["uid"] == pool["metadata"]["uid"] and owner["controller"] is True
        assert live[key]["metadata"]["labels"][POOL_LABEL] == "llama"

    prefill = container(live[("Deployment", "llama-prefill")])
    decode = container(live[("Deployment", "llama-decode")])
    assert prefill["image"] == decode["image"] == "pdserve:0.1.0"
    assert flag(prefill["args"], "--role") == "prefill"
    assert flag(prefill["args"], "--max-num-batched-tokens") == "2048"
    assert flag(decode["args"], "--max-num-batched-tokens") == "256"
    assert decode["resources"]["limits"][api.GPU_RESOURCE] == "1"
    assert decode["readinessProbe"]["httpGet"]["path"] == "/ready"
    routing = json.loads(live[("ConfigMap", "llama-routing")]["data"]["routing.json"])
    assert [b["mode"] for b in routing["buckets"]] == ["colocated", "disaggregated"]

    # kwok's pods are Ready; the status counts them.
    pods = get_json(cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=llama")
    ready = [
        p for p in pods["items"]
        if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
    ]  # fmt: skip
    assert len(ready) == 3
    status = pool["status"]
    assert status["prefill"] == {"desiredReplicas": 1, "readyReplicas": 1, "summary": "1/1"}
    assert status["decode"] == {"desiredReplicas": 1, "readyReplicas": 1, "summary": "1/1"}
    assert status["router"]["readyReplicas"] == 1
    assert status["routerEndpoint"] == f"http://llama-router.{namespace}.svc:8000"
    assert condition(pool, "Ready")["status"] == "True"
    assert condition(pool, "Degraded")["status"] == "False"
    assert condition(pool, "Progressing")["status"] == "False"

    # The printer columns, and Events saying what the operator did.
    (row,) = columns(cluster.kubectl("get", "sp", "-n", namespace, "-o", "wide").stdout)
    assert row["NAME"] == "llama" and row["MODEL"] == "tiny-llama"
    assert (row["PREFILL"], row["DECODE"], row["PHASE"]) == ("1/1", "1/1", "Ready")
    assert row["ENDPOINT"] == status["routerEndpoint"]
    reasons = wait_until(
        lambda: (r := event_reasons(cluster, namespace, "llama")) and "Ready" in r and r,
        WAIT,
        "Events",
    )
    assert "Applied" in reasons
    assert operator.total("pdserve_operator_reconciles_total", trigger="create") == 1
    assert wait_until(operator.healthy, WAIT, "the operator's liveness probe")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"decode": {"engine": {"maxNumBatchedTokens": 512}}}, {("Deployment", "pool-decode")}),
        ({"decode": {"replicas": 3}}, {("Deployment", "pool-decode")}),
        (
            {
                "routing": {
                    "buckets": [
                        {"maxInputTokens": 1024, "mode": "colocated"},
                        {"mode": "colocated"},
                    ]
                }
            },
            {("ConfigMap", "pool-routing"), ("Deployment", "pool-router")},
        ),
    ],
    ids=["chunk-budget", "replicas", "bucket"],
)
def test_spec_change_rolls_out_to_exactly_the_objects_it_affects(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    change: dict[str, Any],
    expected: set[Key],
) -> None:
    apply_pool(cluster, namespace, pool_manifest("pool"))
    wait_ready(cluster, namespace, "pool")
    before = versions(cluster, namespace, "pool")

    generation = patch_pool(cluster, namespace, "pool", change)
    pool = wait_ready(cluster, namespace, "pool", generation)

    after = versions(cluster, namespace, "pool")
    assert set(after) == set(before)
    assert {key for key in after if after[key] != before[key]} == expected
    # ... and the change is what it should be.
    spec = api.parse_spec(pool["spec"])
    live = children(cluster, namespace, "pool")
    for want in render.render("pool", namespace, spec):
        key = (want["kind"], want["metadata"]["name"])
        assert drift.holds(live[key], want), f"{key} does not hold the new spec"
    assert pool["status"]["decode"]["readyReplicas"] == spec.decode.replicas


def test_restart_and_noop_resync_change_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("quiet"))
    wait_ready(cluster, namespace, "quiet")
    before = settled_versions(cluster, namespace, "quiet")

    operator.restart()
    wait_until(
        lambda: operator.total(
            "pdserve_operator_reconcile_duration_seconds_count", trigger="resume"
        ),
        WAIT,
        "the restarted operator to resume the pool",
    )
    assert resource_versions(cluster, namespace, "quiet") == before
    assert writes(operator) == [0, 0, 0]

    # An edit of a field the operator does not own is seen, left alone, and costs no write.
    seen = operator.total("pdserve_operator_watch_events_total", kind="Deployment")
    cluster.kubectl(
        "annotate", "deployment", "quiet-decode", "-n", namespace, "example.com/note=hi"
    )
    wait_until(
        lambda: operator.total("pdserve_operator_watch_events_total", kind="Deployment") > seen,
        WAIT,
        "the operator to see the annotated Deployment",
    )
    deployment = get_json(cluster, "deployment", "quiet-decode", "-n", namespace)
    assert deployment["metadata"]["annotations"]["example.com/note"] == "hi"
    assert writes(operator) == [0, 0, 0]


def test_hand_edits_are_put_back_and_deleted_children_recreated(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("fixed"))
    wait_ready(cluster, namespace, "fixed")
    before = versions(cluster, namespace, "fixed")

    cluster.kubectl("scale", "deployment", "fixed-decode", "-n", namespace, "--replicas=5")
    cluster.kubectl("set", "image", "deployment/fixed-decode", "-n", namespace, "decode=evil:1")

    def put_back() -> bool:
        deployment = get_json(cluster, "deployment", "fixed-decode", "-n", namespace)
        return bool(
            deployment["spec"]["replicas"] == 2
            and container(deployment)["image"] == "pdserve:0.1.0"
        )

    wait_until(put_back, WAIT, "the decode Deployment to be put back")

    deleted = [
        ("Service", "fixed-decode"),
        ("ConfigMap", "fixed-routing"),
        ("Deployment", "fixed-router"),
    ]
    for kind, name in deleted:
        cluster.kubectl("delete", kind.lower(), name, "-n", namespace, "--wait=true")

    def recreated() -> bool:
        now = versions(cluster, namespace, "fixed")
        return all(key in now and now[key][0] != before[key][0] for key in deleted)

    wait_until(recreated, WAIT, "the deleted children to be recreated")
    wait_ready(cluster, namespace, "fixed")
    # Events are posted apart from the status: one may show before the other.
    wait_until(
        lambda: "Repaired" in event_reasons(cluster, namespace, "fixed"), WAIT, "a Repaired Event"
    )


def test_scaling_a_component_to_zero_prunes_its_objects(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("lean"))
    wait_ready(cluster, namespace, "lean")
    router_objects = {
        ("ConfigMap", "lean-routing"), ("ServiceAccount", "lean-router"), ("Role", "lean-router"),
        ("RoleBinding", "lean-router"), ("Service", "lean-router"), ("Deployment", "lean-router"),
        ("PodDisruptionBudget", "lean-router"),
    }  # fmt: skip
    assert router_objects <= set(children(cluster, namespace, "lean"))

    generation = patch_pool(cluster, namespace, "lean", {"router": {"replicas": 0}})
    pool = wait_ready(cluster, namespace, "lean", generation)
    left = set(children(cluster, namespace, "lean"))
    assert not router_objects & left
    assert ("Deployment", "lean-decode") in left
    assert "routerEndpoint" not in pool["status"]

    generation = patch_pool(cluster, namespace, "lean", {"router": {"replicas": 1}})
    wait_ready(cluster, namespace, "lean", generation)
    assert router_objects <= set(children(cluster, namespace, "lean"))


def test_deleting_the_pool_removes_every_child(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("gone"))
    wait_ready(cluster, namespace, "gone")
    assert children(cluster, namespace, "gone")

    cluster.kubectl("delete", "servingpool", "gone", "-n", namespace, "--wait=true")

    def all_gone() -> bool:
        left = get_json(
            cluster, f"{CHILD_KINDS},replicasets,pods", "-n", namespace,
            "-l", "app.kubernetes.io/instance=gone",
        )  # fmt: skip
        return not left["items"]

    wait_until(all_gone, WAIT, "garbage collection of every child")


def test_pools_in_two_namespaces_do_not_touch_each_other(
    cluster: Cluster, kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    first, second = namespace, make_namespace(cluster, "two-namespaces-b")
    unwatched = make_namespace(cluster, "two-namespaces-unwatched")
    operator = OperatorProcess(kubeconfig, tmp_path / "operator.log", [first, second]).start()
    try:
        for ns in (first, second, unwatched):
            apply_pool(cluster, ns, pool_manifest("twin"))
        pools = {ns: wait_ready(cluster, ns, "twin") for ns in (first, second)}
        for ns, pool in pools.items():
            for obj in children(cluster, ns, "twin").values():
                (owner,) = obj["metadata"]["ownerReferences"]
                assert owner["uid"] == pool["metadata"]["uid"]
        before = versions(cluster, second, "twin")

        generation = patch_pool(cluster, first, "twin", {"decode": {"replicas": 1}})
        wait_ready(cluster, first, "twin", generation)
        cluster.kubectl("delete", "servingpool", "twin", "-n", first, "--wait=true")
        wait_until(
            lambda: not children(cluster, first, "twin"), WAIT, "the first pool's children to go"
        )

        assert versions(cluster, second, "twin") == before
        assert get_pool(cluster, second, "twin")["status"]["phase"] == "Ready"
        # A namespace the operator does not watch is left alone.
        assert not children(cluster, unwatched, "twin")
        assert "status" not in get_pool(cluster, unwatched, "twin")
    finally:
        operator.stop()
        print(f"--- operator log ---\n{operator.tail(80)}")
        for ns in (second, unwatched):
            cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_unschedulable_pool_is_pending_not_ready(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    # More GPUs per worker than the node has: the pods stay Pending, and Ready says why.
    apply_pool(cluster, namespace, pool_manifest("big", decode={"replicas": 1, "gpus": 16}))

    def unschedulable() -> dict[str, Any] | None:
        pool = get_pool(cluster, namespace, "big")
        status = pool.get("status", {})
        ready = [c for c in status.get("conditions", []) if c["type"] == "Ready"]
        named = (
            ready and ready[0]["reason"] == "Unschedulable" and "router 1/1" in ready[0]["message"]
        )
        return pool if named and status.get("phase") == "Pending" else None

    pool = wait_until(unschedulable, WAIT, "phase Pending, Ready naming the scheduler's reason")
    ready = condition(pool, "Ready")
    assert ready["status"] == "False"
    assert ready["message"].startswith("decode 0/1, router 1/1 ready: decode: 1 pod Unschedulable")
    assert "Insufficient nvidia.com/gpu" in ready["message"]
    assert condition(pool, "Progressing")["status"] == "True"
    assert pool["status"]["decode"] == {"desiredReplicas": 1, "readyReplicas": 0, "summary": "0/1"}


def test_an_object_in_the_way_degrades_the_pool_until_it_goes(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    # A Deployment of the same name with another (immutable) selector blocks the apply.
    blocker = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "blocked-decode", "labels": {POOL_LABEL: "blocked"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "other"}},
            "template": {
                "metadata": {"labels": {"app": "other"}},
                "spec": {"containers": [{"name": "other", "image": "other:1"}]},
            },
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(blocker))
    apply_pool(cluster, namespace, pool_manifest("blocked"))

    def degraded() -> dict[str, Any] | None:
        pool = get_pool(cluster, namespace, "blocked")
        return pool if pool.get("status", {}).get("phase") == "Degraded" else None

    pool = wait_until(degraded, WAIT, "phase Degraded")
    assert condition(pool, "Degraded")["reason"] == "ApplyFailed"
    assert "selector" in condition(pool, "Degraded")["message"]
    wait_until(
        lambda: "ApplyFailed" in event_reasons(cluster, namespace, "blocked"),
        WAIT,
        "an ApplyFailed Event",
    )

    cluster.kubectl("delete", "deployment", "blocked-decode", "-n", namespace, "--wait=true")
    pool = wait_ready(cluster, namespace, "blocked")
    assert condition(pool, "Degraded")["status"] == "False"


def test_service_monitor_is_skipped_without_its_crd(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("unmonitored", **MONITORED))
    wait_ready(cluster, namespace, "unmonitored")
    wait_until(
        lambda: "NoServiceMonitorCRD" in event_reasons(cluster, namespace, "unmonitored"),
        WAIT,
        "a Warning that ServiceMonitors are not served",
    )


def test_service_monitor_follows_the_spec_where_the_cluster_serves_them(
    cluster: Cluster, kubeconfig: Path, namespace: str, tmp_path: Path, service_monitors: None
) -> None:
    with running(OperatorProcess(kubeconfig, tmp_path / "operator.log", [namespace])):
        apply_pool(cluster, namespace, pool_manifest("monitored", **MONITORED))
        pool = wait_ready(cluster, namespace, "monitored")
        monitor = get_json(cluster, "servicemonitor", "monitored", "-n", namespace)
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
        assert monitor["spec"]["endpoints"] == [
            {"port": "http", "path": "/metrics", "interval": "15s"}
        ]

        disabled = {"monitoring": {"serviceMonitor": {"enabled": False}}}
        wait_ready(
            cluster, namespace, "monitored", patch_pool(cluster, namespace, "monitored", disabled)
        )
        assert get_json(cluster, "servicemonitor", "monitored", "-n", namespace) is None
