"""ServingPools and their children in the dev cluster, for tests: making, changing and
reading them through kubectl, and waiting for what the operator does with them."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pdserve.operator import api
from support.operator import POOL_LABEL, Cluster, OperatorProcess, get_json, wait_until

CHILD_KINDS = (
    "deployments,services,configmaps,poddisruptionbudgets,serviceaccounts,roles,rolebindings,"
    "networkpolicies"
)
# Kinds whose status a controller keeps writing: their spec changes bump `generation`.
GENERATION_KINDS = {"Deployment", "PodDisruptionBudget"}
WAIT = 60.0
WRITE_VERBS = ("apply", "patch", "delete")

Key = tuple[str, str]


def pool_manifest(name: str, **spec: Any) -> dict[str, Any]:
    """A small CPU pool (decode prefills itself, a router in front); `spec` overrides."""
    base: dict[str, Any] = {
        "model": {"name": "tiny-llama", "path": "/models/tiny-llama", "dtype": "float32"},
        "image": "pdserve:0.1.0",
        "decode": {
            "replicas": 2,
            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
            "engine": {"maxNumBatchedTokens": 256, "maxNumSeqs": 16},
        },
    }
    base.update(spec)
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name},
        "spec": base,
    }


def apply_pool(cluster: Cluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))


def patch_pool(cluster: Cluster, namespace: str, name: str, spec: dict[str, Any]) -> int:
    """Merge `spec` into the pool's spec; the new generation."""
    out = cluster.kubectl(
        "patch", "servingpool", name, "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": spec}), "-o", "json",
    ).stdout  # fmt: skip
    generation: int = json.loads(out)["metadata"]["generation"]
    return generation


def get_pool(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    pool: dict[str, Any] = get_json(cluster, "servingpool", name, "-n", namespace)
    return pool


def children(cluster: Cluster, namespace: str, pool: str) -> dict[Key, dict[str, Any]]:
    """The pool's child objects, by (kind, name)."""
    listed = get_json(cluster, CHILD_KINDS, "-n", namespace, "-l", f"{POOL_LABEL}={pool}")
    return {(o["kind"], o["metadata"]["name"]): o for o in listed["items"]}


def versions(cluster: Cluster, namespace: str, pool: str) -> dict[Key, tuple[str, str]]:
    """(uid, version) of each child: `generation` where controllers write status (a
    spec change bumps it), else resourceVersion."""
    out = {}
    for key, obj in children(cluster, namespace, pool).items():
        meta = obj["metadata"]
        version = meta["generation"] if key[0] in GENERATION_KINDS else meta["resourceVersion"]
        out[key] = (meta["uid"], str(version))
    return out


def resource_versions(cluster: Cluster, namespace: str, pool: str) -> dict[Key, str]:
    """resourceVersion of the pool and of every child (any write at all changes one)."""
    out = {
        k: o["metadata"]["resourceVersion"] for k, o in children(cluster, namespace, pool).items()
    }
    out[("ServingPool", pool)] = get_pool(cluster, namespace, pool)["metadata"]["resourceVersion"]
    return out


def settled_versions(cluster: Cluster, namespace: str, pool: str) -> dict[Key, str]:
    """resourceVersions once two reads in a row agree (controllers have caught up)."""
    previous: dict[str, dict[Key, str]] = {"last": {}}

    def stable() -> dict[Key, str] | None:
        now = resource_versions(cluster, namespace, pool)
        same = now == previous["last"]
        previous["last"] = now
        return now if same else None

    return wait_until(stable, WAIT, "resourceVersions to settle", interval=1.0)


def wait_ready(cluster: Cluster, namespace: str, name: str, generation: int = 1) -> dict[str, Any]:
    """The pool once its status says Ready for `generation`."""

    def ready() -> dict[str, Any] | None:
        pool = get_pool(cluster, namespace, name)
        status = pool.get("status", {})
        done = status.get("observedGeneration") == generation and status.get("phase") == "Ready"
        return pool if done else None

    return wait_until(
        ready, WAIT, f"ServingPool {namespace}/{name} Ready at generation {generation}"
    )


def condition(pool: dict[str, Any], type_: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pool["status"]["conditions"] if c["type"] == type_]
    assert found, f"no {type_} condition in {pool['status']}"
    return found[0]


def events(cluster: Cluster, namespace: str, name: str) -> list[tuple[str, str]]:
    """(reason, message) of the pool's Events."""
    listed = get_json(
        cluster, "events", "-n", namespace,
        "--field-selector", f"involvedObject.kind=ServingPool,involvedObject.name={name}",
    )  # fmt: skip
    return [(e["reason"], e.get("message", "")) for e in listed["items"]]


def event_reasons(cluster: Cluster, namespace: str, name: str) -> list[str]:
    return [reason for reason, _ in events(cluster, namespace, name)]


def make_namespace(cluster: Cluster, prefix: str) -> str:
    """A new namespace named PREFIX-<random>."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    return name


def writes(operator: OperatorProcess) -> list[float]:
    """The operator's write requests so far, by verb (WRITE_VERBS)."""
    return [operator.total("pdserve_operator_api_requests_total", verb=v) for v in WRITE_VERBS]


# A stand-in for the Prometheus Operator's CRD: ServiceMonitors served, schema open.
SERVICE_MONITOR_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "plural": "servicemonitors",
            "singular": "servicemonitor",
            "kind": "ServiceMonitor",
            "listKind": "ServiceMonitorList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}
MONITORED = {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
