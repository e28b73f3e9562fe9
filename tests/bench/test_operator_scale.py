"""The operator at scale: 200 ServingPools created at once, then a no-op resync of all.

A fresh dev cluster (with a second kwok node, so 400 pods fit) and the operator as a
process under its own ServiceAccount. A FlowSchema of its own makes the API server
count exactly the operator's requests (apiserver_flowcontrol_dispatched_requests_total),
kopf's watches and Events included. Measured:
  create: time from `kubectl create` of all pools until the operator has applied
          every pool's children (observedGeneration set) and until every pool is
          Ready (then kube-controller-manager's work dominates), operator requests
          per pool, peak RSS;
  resync: the operator restarted over the 200 Ready pools: time until it has
          reconciled all, requests per pool, writes (must be none), resourceVersions
          (must not change), peak RSS.
Run with `make bench` (PDSERVE_BENCH_POOLS=N for another count).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.devcluster import DevCluster
from pdserve.devcluster.controlplane import KubectlError
from pdserve.devcluster.nodes import gpu_node, node_schedulable
from pdserve.operator import api
from support.cluster import binaries_or_skip
from support.operator import (
    OPERATOR_ACCOUNT,
    OPERATOR_NAMESPACE,
    OperatorProcess,
    install_crd,
    operator_kubeconfig,
    wait_until,
)
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(1800)]

POOLS = int(os.environ.get("PDSERVE_BENCH_POOLS", "200"))
NAMESPACE = "bench"
OBJECTS_PER_POOL = 10  # ConfigMap, SA, Role, RoleBinding, 2 Services, 2 Deployments, 2 PDBs
FLOW_SCHEMA = "pdserve-operator"
CHILDREN = "deployments,services,configmaps,poddisruptionbudgets,serviceaccounts,roles,rolebindings"
# About 1.5 s a pool on two loaded cores (the 200-pool run took 309 s); never under 20 min.
READY_TIMEOUT = max(1200.0, 1.5 * POOLS)
# Listing every pool is itself load on the API server: poll less often as pools grow.
POLL_INTERVAL = max(1.0, POOLS / 200)
KCM_WRITES = {
    ("replicasets", ""),
    ("replicasets", "status"),
    ("deployments", "status"),
    ("poddisruptionbudgets", "status"),
    ("endpointslices", ""),
    ("pods", ""),
}

FLOW_SCHEMA_MANIFEST = {
    "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
    "kind": "FlowSchema",
    "metadata": {"name": FLOW_SCHEMA},
    "spec": {
        "priorityLevelConfiguration": {"name": "workload-high"},
        "matchingPrecedence": 500,
        "distinguisherMethod": {"type": "ByUser"},
        "rules": [
            {
                "subjects": [
                    {
                        "kind": "ServiceAccount",
                        "serviceAccount": {
                            "name": OPERATOR_ACCOUNT,
                            "namespace": OPERATOR_NAMESPACE,
                        },
                    }
                ],
                "resourceRules": [
                    {
                        "verbs": ["*"],
                        "apiGroups": ["*"],
                        "resources": ["*"],
                        "clusterScope": True,
                        "namespaces": ["*"],
                    }
                ],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            }
        ],
    },
}


def pool(name: str) -> dict[str, Any]:
    """One small pool: a decode worker (which prefills too) and a router."""
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "tiny-llama", "path": "/models/tiny-llama", "dtype": "float32"},
            "image": "pdserve:0.1.0",
            "decode": {
                "replicas": 1,
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                "engine": {"maxNumBatchedTokens": 256, "maxNumSeqs": 16},
            },
        },
    }


def get_node(cluster: DevCluster, name: str) -> dict[str, Any]:
    node: dict[str, Any] = json.loads(cluster.kubectl("get", "node", name, "-o", "json").stdout)
    return node


@pytest.fixture(scope="module")
def cluster() -> Iterator[DevCluster]:
    """A fresh cluster for clean counts, with room for 400 pods."""
    binaries_or_skip()
    with DevCluster() as started:
        node = gpu_node("kwok-bench-0", gpus=0, cpu="1000", memory="4Ti", pods=1000)
        started.kubectl("create", "-f", "-", input=json.dumps(node))
        wait_until(lambda: node_schedulable(get_node(started, "kwok-bench-0")), 120, "bench node")
        yield started


def dispatched(cluster: DevCluster) -> float:
    """Requests the API server has dispatched for the operator's FlowSchema so far."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "apiserver_flowcontrol_dispatched_requests"
        for sample in family.samples
        if sample.labels.get("flow_schema") == FLOW_SCHEMA
    )


def controller_writes(cluster: DevCluster) -> float:
    """Writes only kube-controller-manager makes (ReplicaSets, pods, EndpointSlices,
    Deployment/ReplicaSet/PDB statuses), from the API server's request counts."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "apiserver_request"
        for sample in family.samples
        if sample.name == "apiserver_request_total"
        and sample.labels.get("verb") in ("POST", "PUT", "PATCH")
        and (sample.labels.get("resource"), sample.labels.get("subresource", "")) in KCM_WRITES
    )


def mib(size: int) -> float:
    return round(size / 2**20, 1)


def writes(operator: OperatorProcess) -> int:
    """Applies, patches and deletes the operator's reconciler sent."""
    total = "pdserve_operator_api_requests_total"
    return int(sum(operator.total(total, verb=v) for v in ("apply", "patch", "delete")))


def pool_states(cluster: DevCluster) -> list[tuple[str, str]]:
    """(phase, observedGeneration) of every pool ("" where not set yet); none when the
    API server, busy with thousands of pools, answers the list with a timeout (the next
    poll asks again)."""
    template = "{range .items[*]}{.status.phase},{.status.observedGeneration}{'\\n'}{end}"
    try:
        out = cluster.kubectl("get", "servingpools", "-n", NAMESPACE, "-o", f"jsonpath={template}")
    except KubectlError as error:
        print(f"listing the pools failed, polling again: {error.stderr.strip()[:200]}")
        return []
    rows = (line.partition(",") for line in out.stdout.splitlines())
    return [(phase, generation) for phase, _, generation in rows]


def resource_versions(cluster: DevCluster) -> dict[str, str]:
    """kind/name -> resourceVersion of every pool and child in the bench namespace."""
    template = "{range .items[*]}{.kind}/{.metadata.name} {.metadata.resourceVersion}{'\\n'}{end}"
    out = cluster.kubectl(
        "get", f"servingpools,{CHILDREN}", "-n", NAMESPACE, "-o", f"jsonpath={template}"
    ).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if line.strip())


def settled(cluster: DevCluster) -> dict[str, str]:
    """resourceVersions once two reads 2 s apart agree (the controllers are done)."""
    last: dict[str, dict[str, str]] = {"seen": {}}

    def stable() -> dict[str, str] | None:
        try:
            now = resource_versions(cluster)
        except KubectlError:
            return None  # a list timed out under load: read again
        same = now == last["seen"]
        last["seen"] = now
        return now if same else None

    return wait_until(stable, max(300.0, POOLS * 0.3), "the cluster to settle", interval=2.0)


def test_operator_scale(cluster: DevCluster, tmp_path: Path) -> None:
    install_crd(cluster)
    kubeconfig = operator_kubeconfig(cluster, tmp_path / "kubeconfig")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(FLOW_SCHEMA_MANIFEST))
    cluster.kubectl("create", "namespace", NAMESPACE)
    manifests = tmp_path / "pools.yaml"
    manifests.write_text(yaml.safe_dump_all([pool(f"pool-{i:03d}") for i in range(POOLS)]))

    operator = OperatorProcess(kubeconfig, tmp_path / "operator.log").start()
    try:
        create = measure_create(cluster, operator, manifests)
        quiet = settled(cluster)
        create["peak_rss_mib"] = mib(operator.peak_rss_bytes())
        operator.stop()
        resync = measure_resync(cluster, operator, quiet)
    finally:
        operator.stop()
        print(f"--- operator log ---\n{operator.tail(30)}")

    publish(
        "operator_scale",
        [create, resync],
        extra={
            "pools": POOLS,
            "objects_per_pool": OBJECTS_PER_POOL,
            "note": "seconds_to_applied is the operator's part; after it the pools wait on "
            "kube-controller-manager creating ReplicaSets and pods and reporting status "
            "(controller_writes_per_s: its write rate until all are Ready)",
        },
    )
    assert resync["writes"] == 0
    assert resync["changed_resource_versions"] == 0


def measure_create(
    cluster: DevCluster, operator: OperatorProcess, manifests: Path
) -> dict[str, Any]:
    """Create every pool at once; wait for all to be Ready."""
    requests_before = dispatched(cluster)
    controllers_before = controller_writes(cluster)
    started = time.monotonic()
    cluster.kubectl("create", "-f", str(manifests))
    applied_at: list[float] = []

    def all_ready() -> bool:
        states = pool_states(cluster)
        if not applied_at and sum(1 for _, generation in states if generation) == POOLS:
            applied_at.append(time.monotonic() - started)  # every pool applied, status written
        return sum(1 for phase, _ in states if phase == "Ready") == POOLS

    wait_until(all_ready, READY_TIMEOUT, f"{POOLS} pools Ready", interval=POLL_INTERVAL)
    seconds = time.monotonic() - started
    requests = dispatched(cluster) - requests_before
    controllers = controller_writes(cluster) - controllers_before
    return {
        "phase": f"create {POOLS}",
        "seconds_to_ready": round(seconds, 1),
        "seconds_to_applied": round(applied_at[0], 1) if applied_at else None,
        "operator_requests": int(requests),
        "requests_per_pool": round(requests / POOLS, 1),
        "writes": writes(operator),
        "changed_resource_versions": None,
        "peak_rss_mib": mib(operator.peak_rss_bytes()),
        "controller_writes_per_s": round(controllers / seconds, 1),
    }


def measure_resync(
    cluster: DevCluster, operator: OperatorProcess, before: dict[str, str]
) -> dict[str, Any]:
    """Restart the operator over Ready pools: every pool is resumed, nothing written."""
    requests_before = dispatched(cluster)
    started = time.monotonic()
    operator.start()
    resumed = "pdserve_operator_reconcile_duration_seconds_count"
    wait_until(
        lambda: operator.total(resumed, trigger="resume") >= POOLS,
        READY_TIMEOUT,
        f"{POOLS} pools resumed",
        interval=0.5,
    )
    seconds = time.monotonic() - started
    after = resource_versions(cluster)
    requests = dispatched(cluster) - requests_before
    return {
        "phase": f"no-op resync {POOLS}",
        "seconds_to_ready": round(seconds, 1),
        "seconds_to_applied": None,
        "operator_requests": int(requests),
        "requests_per_pool": round(requests / POOLS, 1),
        "writes": writes(operator),
        "changed_resource_versions": sum(1 for k, v in after.items() if before.get(k) != v),
        "peak_rss_mib": mib(operator.peak_rss_bytes()),
        "controller_writes_per_s": None,
    }
