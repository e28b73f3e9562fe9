"""The simulated GPU node that kwok keeps Ready, and how to tell it can take pods."""

from __future__ import annotations

from typing import Any

from pdserve.devcluster.components import NODE_ANNOTATION, NODE_ANNOTATION_VALUE

GPU_RESOURCE = "nvidia.com/gpu"


def gpu_node(
    name: str, gpus: int = 8, cpu: str = "64", memory: str = "512Gi", pods: int = 110
) -> dict[str, Any]:
    """A Node object for kwok to manage, offering `gpus` GPUs as an extended resource.

    The capacity is set at creation: kwok's node stage keeps it and marks the node
    Ready, as a kubelet with the NVIDIA device plugin would.
    """
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {NODE_ANNOTATION: NODE_ANNOTATION_VALUE},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def _condition(node: dict[str, Any], kind: str) -> str | None:
    for condition in node.get("status", {}).get("conditions", []):
        if condition.get("type") == kind:
            status: str = condition.get("status", "")
            return status
    return None


def node_schedulable(node: dict[str, Any] | None) -> bool:
    """Whether the node is Ready and untainted, so the scheduler will place pods on it.

    Ready alone is not enough: the node lifecycle controller taints a new node
    not-ready until it sees it Ready, and removes the taint a moment later.
    """
    if node is None:
        return False
    return _condition(node, "Ready") == "True" and not node.get("spec", {}).get("taints")
