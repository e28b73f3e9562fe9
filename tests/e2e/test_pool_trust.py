"""A pool's trust boundaries against the real API server: who its NetworkPolicy
admits (the peers the API server selects, pods made here to be admitted or not), and
what the operator does with a Secret it did not create under the name of a pool's
credential (nothing: the pool says so). The operator runs under the chart's identity,
which cannot read a Secret at all (tests/e2e/test_chart.py asks `kubectl auth can-i`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from pdserve.operator.controller.kube import ApiError, KubeClient, load_credentials
from pdserve.operator.controller.reconcile import Reconciler
from support.operator import Cluster, OperatorProcess, get_json, running
from support.policy import rule_pods, selected_pods
from support.pool_cluster import apply_pool, condition, get_pool, make_namespace, pool_manifest
from support.waiting import wait_until

pytestmark = pytest.mark.cluster

WAIT = 90.0
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def make_pod(cluster: Cluster, namespace: str, name: str, labels: dict[str, str]) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "scraper:1"}]},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))


@pytest.fixture
def other_namespaces(cluster: Cluster) -> Iterator[dict[str, str]]:
    """A monitoring namespace and another one, deleted afterwards."""
    made = {"monitoring": make_namespace(cluster, "monitoring"),
            "elsewhere": make_namespace(cluster, "elsewhere")}  # fmt: skip
    yield made
    for name in made.values():
        cluster.kubectl("delete", "namespace", name, "--wait=false")


def pool_pods(cluster: Cluster, namespace: str, pool: str, count: int) -> set[tuple[str, str]]:
    def listed() -> set[tuple[str, str]] | None:
        found = get_json(
            cluster, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={pool}"
        )
        pods = {(namespace, item["metadata"]["name"]) for item in found["items"]}
        return pods if len(pods) == count else None

    return wait_until(listed, WAIT, f"{count} pods of pool {pool}")


def test_the_network_policy_admits_the_pool_and_its_monitoring_namespace_only(
    cluster: Cluster,
    kubeconfig: Path,
    namespace: str,
    other_namespaces: dict[str, str],
    tmp_path: Path,
) -> None:
    monitoring, elsewhere = other_namespaces["monitoring"], other_namespaces["elsewhere"]
    args = ["--prometheus-namespace", monitoring]
    with running(OperatorProcess(kubeconfig, tmp_path / "operator.log", [namespace], args=args)):
        apply_pool(cluster, namespace, pool_manifest("guarded", decode={"replicas": 2}))
        policy = wait_until(
            lambda: get_json(cluster, "networkpolicy", "guarded-workers", "-n", namespace),
            WAIT, "the NetworkPolicy",
        )  # fmt: skip
        members = pool_pods(cluster, namespace, "guarded", 3)  # 2 decode workers, the router
    # A Prometheus anywhere else, and one beside the pool: the label admits neither.
    make_pod(cluster, elsewhere, "prometheus", PROMETHEUS)
    make_pod(cluster, namespace, "prometheus", PROMETHEUS)
    make_pod(cluster, monitoring, "scraper", {})
    workers = {pod for pod in members if "-decode-" in pod[1]}
    assert selected_pods(cluster, policy) == workers

    metrics_port = rule_pods(cluster, policy, "ingress", "http")
    assert (elsewhere, "prometheus") not in metrics_port
    assert (namespace, "prometheus") not in metrics_port
    assert metrics_port == members | {(monitoring, "scraper")}
    # Other ports (KV transfer's): the pool's pods only.
    assert rule_pods(cluster, policy, "ingress", 5555) == members
    # Out: the pool's pods, and DNS on port 53 (anywhere) only.
    assert rule_pods(cluster, policy, "egress", "http") == members
    assert rule_pods(cluster, policy, "egress", 443) == members
    dns = [rule for rule in policy["spec"]["egress"] if "to" not in rule]
    assert dns == [{"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}]


def conflict_of(cluster: Cluster, namespace: str, pool: str) -> dict[str, Any] | None:
    status = get_pool(cluster, namespace, pool).get("status") or {}
    degraded = [c for c in status.get("conditions", []) if c["type"] == "Degraded"]
    return degraded[0] if degraded and degraded[0]["reason"] == "SecretConflict" else None


def test_a_foreign_secret_is_never_adopted(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "taken-internal", "labels": {"owner": "someone-else"}},
        "stringData": {"token": "not-the-pools-credential-0123456789"},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(foreign))
    before = get_json(cluster, "secret", "taken-internal", "-n", namespace)
    apply_pool(cluster, namespace, pool_manifest("taken", decode={"replicas": 1}))
    degraded = wait_until(lambda: conflict_of(cluster, namespace, "taken"), WAIT,
                          "the pool to name the conflict")  # fmt: skip
    assert degraded["status"] == "True"
    assert (
        f"Secret {namespace}/taken-internal exists but was not created for this pool"
        in (degraded["message"])
    )
    assert get_pool(cluster, namespace, "taken")["status"]["phase"] == "Degraded"
    # Untouched: no owner, no label, no write at all.
    after = get_json(cluster, "secret", "taken-internal", "-n", namespace)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
    # Deleting the pool leaves it to its owner: the garbage collector removes the pool's
    # children, never it.
    cluster.kubectl("delete", "servingpool", "taken", "-n", namespace, "--wait=true")
    wait_until(
        lambda: get_json(cluster, "deployment", "taken-decode", "-n", namespace) is None,
        WAIT, "the garbage collector to remove the pool's Deployment",
    )  # fmt: skip
    kept = get_json(cluster, "secret", "taken-internal", "-n", namespace)
    assert kept["metadata"]["uid"] == before["metadata"]["uid"]

    # Once its owner deletes it, a pool of that name gets a credential of its own, and
    # the status records it (so a restarted operator knows it as the pool's).
    apply_pool(cluster, namespace, pool_manifest("taken", decode={"replicas": 1}))
    wait_until(lambda: conflict_of(cluster, namespace, "taken"), WAIT, "the conflict again")
    cluster.kubectl("delete", "secret", "taken-internal", "-n", namespace)

    def recorded() -> dict[str, Any] | None:
        pool = get_pool(cluster, namespace, "taken")
        made = (pool.get("status") or {}).get("credentialSecret")
        return pool if made and condition(pool, "Degraded")["status"] == "False" else None

    pool = wait_until(recorded, 2 * WAIT, "the pool's own credential Secret")
    secret = get_json(cluster, "secret", "taken-internal", "-n", namespace)
    assert pool["status"]["credentialSecret"] == {
        "name": "taken-internal", "uid": secret["metadata"]["uid"],
    }  # fmt: skip
    assert secret["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    assert secret["metadata"]["labels"]["pdserve.dev/pool"] == "taken"


class Silent:
    """Events go nowhere: the test reads the API server, not the Events."""

    def normal(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        pass

    def warning(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        pass


async def reconcile_late(kubeconfig: Path, pool: dict[str, Any]) -> None:
    """One reconcile of `pool` under the operator's identity, as a retry that was
    already running when the pool was deleted would end."""
    client = KubeClient(load_credentials(kubeconfig))
    try:
        await Reconciler(client, Silent()).reconcile(pool, [], trigger="retry")
    except ApiError:
        pass  # e.g. its RoleBinding's Role, owned by no pool, already collected
    finally:
        await client.close()


def test_a_reconcile_that_outlives_its_pool_never_writes_the_next_pools_status(
    cluster: Cluster, namespace: str, kubeconfig: Path
) -> None:
    # No operator runs: the late reconcile is the only writer, and its ordering is the
    # test's (the pool deleted and one of its name created before the reconcile ends).
    apply_pool(cluster, namespace, pool_manifest("reused", decode={"replicas": 1}))
    deleted = get_pool(cluster, namespace, "reused")
    cluster.kubectl("delete", "servingpool", "reused", "-n", namespace, "--wait=true")
    apply_pool(cluster, namespace, pool_manifest("reused", decode={"replicas": 2}))
    current = get_pool(cluster, namespace, "reused")
    assert current["metadata"]["uid"] != deleted["metadata"]["uid"]

    asyncio.run(reconcile_late(kubeconfig, deleted))

    after = get_pool(cluster, namespace, "reused")
    assert after["metadata"]["uid"] == current["metadata"]["uid"]
    assert "status" not in after, "the deleted pool's reconcile wrote the new pool's status"
    # What it created names the deleted pool as owner, so the garbage collector takes it.
    secret = get_json(cluster, "secret", "reused-internal", "-n", namespace)
    if secret is not None:
        owners = {ref["uid"] for ref in secret["metadata"]["ownerReferences"]}
        assert owners == {deleted["metadata"]["uid"]}
