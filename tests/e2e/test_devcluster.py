"""The dev cluster behaves like a real cluster with one 8-GPU node."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.devcluster import DevCluster

K8S_VERSION = "v1.36.3"


@pytest.fixture
def namespace(cluster: DevCluster) -> Iterator[str]:
    """A fresh namespace, deleted after the test (without waiting)."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def gpu_deployment(name: str, replicas: int, gpus: int) -> dict[str, Any]:
    """A Deployment whose pods each ask for `gpus` GPUs."""
    labels = {"app": name}
    container = {
        "name": "worker",
        # Never pulled: kwok only pretends to run containers.
        "image": "registry.invalid/pdserve-worker:e2e",
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def get_json(cluster: DevCluster, *args: str) -> dict[str, Any]:
    """`kubectl get ... -o json`, decoded."""
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def ready(pod: dict[str, Any]) -> bool:
    """Whether a pod's Ready condition is True."""
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_for(check: Any, timeout: float = 60.0) -> None:
    """Poll `check()` until it is truthy."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout}s"
        time.sleep(0.5)


def deploy(cluster: DevCluster, namespace: str, name: str, replicas: int, gpus: int) -> None:
    """Apply a GPU Deployment and wait for its rollout."""
    manifest = json.dumps(gpu_deployment(name, replicas, gpus))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    cluster.kubectl("rollout", "status", "-n", namespace, f"deployment/{name}", "--timeout=90s")


def test_server_and_client_report_the_built_version(cluster: DevCluster) -> None:
    server = json.loads(cluster.kubectl("get", "--raw", "/version").stdout)
    assert server["gitVersion"] == K8S_VERSION
    assert (server["major"], server["minor"]) == ("1", "36")
    client = json.loads(cluster.kubectl("version", "--client", "-o", "json").stdout)
    assert client["clientVersion"]["gitVersion"] == K8S_VERSION


def test_node_offers_eight_gpus(cluster: DevCluster) -> None:
    node = get_json(cluster, "node", cluster.node_name)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"


def test_gpu_deployment_gets_ready_pods_on_the_gpu_node(
    cluster: DevCluster, namespace: str
) -> None:
    deploy(cluster, namespace, "decode", replicas=2, gpus=1)
    pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=decode")["items"]
    assert len(pods) == 2
    assert all(ready(pod) for pod in pods)
    assert {pod["spec"]["nodeName"] for pod in pods} == {cluster.node_name}
    deployment = get_json(cluster, "deployment", "-n", namespace, "decode")
    assert deployment["status"]["readyReplicas"] == 2


def test_pod_asking_for_more_gpus_than_the_node_has_stays_pending(
    cluster: DevCluster, namespace: str
) -> None:
    manifest = json.dumps(gpu_deployment("too-big", replicas=1, gpus=9))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)

    def unschedulable() -> bool:
        pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=too-big")["items"]
        conditions = pods[0].get("status", {}).get("conditions", []) if pods else []
        return any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conditions)

    wait_for(unschedulable)
    pod = get_json(cluster, "pods", "-n", namespace, "-l", "app=too-big")["items"][0]
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


def test_deleting_a_deployment_garbage_collects_replicasets_and_pods(
    cluster: DevCluster, namespace: str
) -> None:
    deploy(cluster, namespace, "prefill", replicas=2, gpus=1)
    assert get_json(cluster, "replicasets", "-n", namespace, "-l", "app=prefill")["items"]

    cluster.kubectl("delete", "-n", namespace, "deployment/prefill", "--wait=false")

    def collected() -> bool:
        left = get_json(cluster, "replicasets,pods", "-n", namespace, "-l", "app=prefill")
        return not left["items"]

    wait_for(collected)


def test_custom_resource_definition_becomes_established_and_usable(
    cluster: DevCluster, namespace: str
) -> None:
    group = f"g{uuid.uuid4().hex[:8]}.e2e.pdserve.dev"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {"size": {"type": "integer"}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(crd))
    try:
        cluster.kubectl(
            "wait", "--for", "condition=established", f"crd/widgets.{group}", "--timeout=60s"
        )
        widget = {
            "apiVersion": f"{group}/v1",
            "kind": "Widget",
            "metadata": {"name": "w1"},
            "spec": {"size": 3},
        }
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(widget))
        stored = get_json(cluster, f"widgets.{group}", "-n", namespace, "w1")
        assert stored["spec"] == {"size": 3}
    finally:
        cluster.kubectl("delete", f"crd/widgets.{group}", "--wait=false", check=False)
