"""The kustomize base in deploy/: it renders with kubectl's kustomize, holds what the
chart installs with its default values, and applies to the real control plane, where
the operator's Deployment passes the restricted Pod Security Standard."""

from __future__ import annotations

from typing import Any

import pytest

from render_deploy import DEPLOY, NAMESPACE, objects, template
from support.operator import Cluster, get_json

pytestmark = pytest.mark.cluster

Key = tuple[str, str, str]


def keyed(items: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    return {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in items
    }


def test_the_base_is_the_chart_with_default_values(cluster: Cluster) -> None:
    rendered = keyed(objects(cluster.kubectl("kustomize", str(DEPLOY)).stdout))
    chart = keyed(objects(template()))
    extra = {key for key in rendered if key not in chart}
    assert extra == {
        ("Namespace", "", NAMESPACE),
        ("CustomResourceDefinition", "", "servingpools.pdserve.dev"),
    }
    for key, obj in chart.items():
        labels = {
            k: v
            for k, v in obj["metadata"]["labels"].items()
            if k not in ("helm.sh/chart", "app.kubernetes.io/managed-by")
        }
        assert rendered[key] == {**obj, "metadata": {**obj["metadata"], "labels": labels}}, key


def test_the_base_applies_and_the_operator_deployment_becomes_available(
    cluster: Cluster,
) -> None:
    try:
        applied = cluster.kubectl("apply", "--server-side", "-k", str(DEPLOY))
        assert "Warning" not in applied.stderr, applied.stderr
        namespace = get_json(cluster, "namespace", NAMESPACE)
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == (
            "restricted"
        )
        cluster.kubectl(
            "rollout", "status", "deployment/pdserve-operator", "-n", NAMESPACE, "--timeout=90s"
        )
    finally:
        # The namespace, identity and CRD stay: the operator's tests share them.
        cluster.kubectl(
            "delete", "deployment,service,configmap", "-n", NAMESPACE,
            "-l", "app.kubernetes.io/instance=pdserve", "--ignore-not-found",
        )  # fmt: skip
