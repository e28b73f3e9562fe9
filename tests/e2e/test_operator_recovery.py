"""The operator recovers what the watches alone would miss, on a real control plane:
a write the API server refused (retried with backoff, no spec change needed), a child
deleted while the operator was down, drift no watch reports (the periodic resync);
and it keeps nothing of a deleted pool.

The API server refuses the operator's writes through a ValidatingAdmissionPolicy
that matches only the operator's ServiceAccount and one object: a real refusal,
switched on and off by the test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from support.operator import (
    OPERATOR_USER,
    Cluster,
    OperatorProcess,
    get_json,
    running,
    wait_until,
)
from support.pool_cluster import (
    MONITORED,
    WAIT,
    apply_pool,
    children,
    condition,
    event_reasons,
    events,
    get_pool,
    pool_manifest,
    resource_versions,
    settled_versions,
    wait_ready,
    writes,
)

pytestmark = pytest.mark.cluster

ADMISSION = "admissionregistration.k8s.io/v1"


def refusal(name: str, namespace: str, resource: str, object_name: str) -> list[dict[str, Any]]:
    """A policy and its binding: the operator may not create or update this one object."""
    policy = {
        "apiVersion": ADMISSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": [resource],
                    }
                ]
            },
            "matchConditions": [
                {
                    "name": "operator",
                    "expression": f"request.userInfo.username == '{OPERATOR_USER}'",
                }
            ],
            "validations": [
                {
                    "expression": f"object.metadata.name != '{object_name}'",
                    "message": f"{object_name} is refused by the test's policy",
                }
            ],
        },
    }
    binding = {
        "apiVersion": ADMISSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            },
        },
    }
    return [policy, binding]


@contextmanager
def refused(cluster: Cluster, namespace: str, configmap: str) -> Iterator[None]:
    """While inside, the API server refuses the operator's writes of this ConfigMap.

    Entered once the policy is in force: a server-side dry run of the write, made as
    the operator, is refused (policies take effect a moment after they are created).
    """
    manifests = refusal(f"refuse-{namespace}", namespace, "configmaps", configmap)
    documents = {"apiVersion": "v1", "kind": "List", "items": manifests}
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": configmap}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(documents))
    try:

        def in_force() -> bool:
            attempt = cluster.kubectl(
                "apply", "--server-side", "--dry-run=server", "--field-manager=probe",
                "--as", OPERATOR_USER, "-n", namespace, "-f", "-",
                input=json.dumps(probe), check=False,
            )  # fmt: skip
            return attempt.returncode != 0 and "refused by the test's policy" in attempt.stderr

        wait_until(in_force, WAIT, "the refusal policy to be in force", interval=0.5)
        yield
    finally:
        cluster.kubectl("delete", "-f", "-", "--wait=true", input=json.dumps(documents))


def degraded(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The pool while its status says Degraded."""
    pool = get_pool(cluster, namespace, name)
    return pool if pool.get("status", {}).get("phase") == "Degraded" else None


def test_a_refused_repair_is_retried_until_it_succeeds_without_a_spec_change(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("retried"))
    generation = wait_ready(cluster, namespace, "retried")["metadata"]["generation"]

    with refused(cluster, namespace, "retried-routing"):
        cluster.kubectl("delete", "configmap", "retried-routing", "-n", namespace)
        # The repair is refused, then retried (and refused again): the status says so.
        pool = wait_until(lambda: degraded(cluster, namespace, "retried"), WAIT, "Degraded")
        assert condition(pool, "Degraded")["reason"] == "ApplyFailed"
        assert "refused by the test's policy" in condition(pool, "Degraded")["message"]
        wait_until(
            lambda: "RepairFailed" in event_reasons(cluster, namespace, "retried"),
            WAIT,
            "a RepairFailed Event",
        )

    # Nothing changes the pool or its children now: only the retry can bring it back.
    pool = wait_ready(cluster, namespace, "retried", generation)
    assert pool["metadata"]["generation"] == generation
    assert ("ConfigMap", "retried-routing") in children(cluster, namespace, "retried")
    assert operator.total("pdserve_operator_reconciles_total", trigger="retry") >= 2
    # The retry says what it did, as every reconcile does.
    wait_until(
        lambda: (
            ("Applied", "created ConfigMap retried-routing")
            in events(cluster, namespace, "retried")
        ),
        WAIT,
        "an Event for the recreated ConfigMap",
    )


def test_deleting_a_pool_leaves_no_state_in_the_operator(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("dropped"))
    wait_ready(cluster, namespace, "dropped")
    assert operator.total("pdserve_operator_pools") == 1

    with refused(cluster, namespace, "dropped-routing"):
        cluster.kubectl("delete", "configmap", "dropped-routing", "-n", namespace)
        wait_until(lambda: degraded(cluster, namespace, "dropped"), WAIT, "Degraded")
        wait_until(
            lambda: operator.total("pdserve_operator_retries_pending") == 1,
            WAIT,
            "a retry to wait (the gauge leaves out one under way)",
        )

        # Deleted while its repair waits for a retry.
        cluster.kubectl("delete", "servingpool", "dropped", "-n", namespace, "--wait=true")

        def forgotten() -> bool:
            pools = operator.total("pdserve_operator_pools")
            return pools == 0 and operator.total("pdserve_operator_retries_pending") == 0

        wait_until(forgotten, WAIT, "the operator to forget the deleted pool")


def test_children_deleted_while_the_operator_is_stopped_come_back_after_restart(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply_pool(cluster, namespace, pool_manifest("restarted"))
    wait_ready(cluster, namespace, "restarted")
    before = children(cluster, namespace, "restarted")

    operator.stop()
    deleted = [("ConfigMap", "restarted-routing"), ("Deployment", "restarted-router")]
    for kind, name in deleted:
        cluster.kubectl("delete", kind.lower(), name, "-n", namespace, "--wait=true")
    operator.start()

    def recreated() -> bool:
        now = children(cluster, namespace, "restarted")
        return all(
            key in now and now[key]["metadata"]["uid"] != before[key]["metadata"]["uid"]
            for key in deleted
        )

    wait_until(recreated, WAIT, "the deleted children to be recreated")
    wait_ready(cluster, namespace, "restarted")


def test_resync_puts_back_what_no_watch_reports_and_writes_nothing_otherwise(
    cluster: Cluster, kubeconfig: Path, namespace: str, tmp_path: Path, service_monitors: None
) -> None:
    process = OperatorProcess(
        kubeconfig, tmp_path / "operator.log", [namespace], args=["--resync-interval", "1"]
    )
    with running(process) as operator:
        apply_pool(cluster, namespace, pool_manifest("resynced", **MONITORED))
        pool = wait_ready(cluster, namespace, "resynced")
        # The loop needs no finalizer: a pool never waits for the operator to be deleted.
        assert not pool["metadata"].get("finalizers")
        before = settled_versions(cluster, namespace, "resynced")
        monitor = get_json(cluster, "servicemonitor", "resynced", "-n", namespace)
        written = writes(operator)

        # Three resyncs over an unchanged pool: no write, no new resourceVersion.
        resyncs = operator.total("pdserve_operator_reconciles_total", trigger="resync")
        wait_until(
            lambda: (
                operator.total("pdserve_operator_reconciles_total", trigger="resync") >= resyncs + 3
            ),
            WAIT,
            "three resyncs",
        )
        assert writes(operator) == written
        assert resource_versions(cluster, namespace, "resynced") == before
        unchanged = get_json(cluster, "servicemonitor", "resynced", "-n", namespace)
        assert unchanged["metadata"]["resourceVersion"] == monitor["metadata"]["resourceVersion"]

        # ServiceMonitors are not watched: only the resync sees this one go.
        created = operator.total(
            "pdserve_operator_object_changes_total", kind="ServiceMonitor", action="created"
        )
        cluster.kubectl("delete", "servicemonitor", "resynced", "-n", namespace, "--wait=true")

        def recreated() -> bool:
            now = get_json(cluster, "servicemonitor", "resynced", "-n", namespace)
            return now is not None and now["metadata"]["uid"] != monitor["metadata"]["uid"]

        wait_until(recreated, WAIT, "the resync to recreate the ServiceMonitor")
        assert (
            operator.total(
                "pdserve_operator_object_changes_total", kind="ServiceMonitor", action="created"
            )
            == created + 1
        )
