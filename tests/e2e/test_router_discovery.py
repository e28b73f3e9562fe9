"""The router against the real control plane: run with a kubeconfig for the router's
own rendered ServiceAccount, it finds the pool's workers from the EndpointSlices of
their Services and follows them as the operator scales the Deployments. kwok plays
the kubelet (the pods turn Ready and get addresses; no worker runs in them), and the
endpointslice controller of kube-controller-manager makes the slices.

Also here: what the operator makes for the trusted internal path (the credential
Secret, mounted, and the NetworkPolicy), and that a hand-made EndpointSlice names no
worker (the router would send it the pool's credential)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from pdserve.base.process import ServerProcess, start_server
from pdserve.operator import api, render
from support.operator import Cluster, OperatorProcess, account_kubeconfig, get_json
from support.router import known_workers
from support.waiting import wait_until

pytestmark = pytest.mark.cluster

POOL = "watched"
WAIT = 90.0


def manifest(decode: int, prefill: int) -> dict[str, Any]:
    spec = {
        "model": {"name": "small", "path": "/models/small", "dtype": "float32"},
        "image": "pdserve:0.1.0",
        "decode": {"replicas": decode, "resources": {"requests": {"cpu": "100m"}}},
        "prefill": {"replicas": prefill, "resources": {"requests": {"cpu": "100m"}}},
        "routing": {
            "buckets": [{"maxInputTokens": 256, "mode": "colocated"}, {"mode": "disaggregated"}]
        },
    }
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": POOL},
        "spec": spec,
    }


def apply(cluster: Cluster, namespace: str, decode: int, prefill: int) -> None:
    body = json.dumps(manifest(decode, prefill))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=body)


def ready_pod_urls(cluster: Cluster, namespace: str, role: str) -> list[str]:
    pods = get_json(
        cluster, "pods", "-n", namespace, "-l",
        f"app.kubernetes.io/instance={POOL},app.kubernetes.io/component={role}",
    )  # fmt: skip
    return sorted(
        f"http://{pod['status']['podIP']}:8000"
        for pod in pods["items"]
        if not pod["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod["status"].get("conditions", [])
        )
        and pod["status"].get("podIP")
    )


@pytest.fixture
def router(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    small_model_dir: Path,
    tmp_path: Path,
) -> Iterator[ServerProcess]:
    """The pool (2 decode, 1 prefill) and a router watching it as its ServiceAccount."""
    apply(cluster, namespace, decode=2, prefill=1)
    wait_until(
        lambda: get_json(cluster, "serviceaccount", f"{POOL}-router", "-n", namespace),
        WAIT, "the router's ServiceAccount",
    )  # fmt: skip
    kubeconfig = account_kubeconfig(
        cluster, namespace, f"{POOL}-router", tmp_path / "router.kubeconfig"
    )
    spec = api.parse_pool(manifest(2, 1)).spec
    model = spec.model.model_copy(update={"path": str(small_model_dir)})
    spec = spec.model_copy(update={"model": model})
    routing = tmp_path / "routing.json"
    routing.write_text(render.routing_json(render.routing_table(POOL, namespace, spec)))
    args = ["--config", str(routing), "--kubeconfig", str(kubeconfig)]
    process = start_server("router", tmp_path / "router.log", args)
    try:
        process.wait_ready(WAIT)
        yield process
    finally:
        process.stop()
        print(f"--- router log ---\n{process.log()[-4000:]}")


def hand_made_slice(service: str, address: str) -> dict[str, Any]:
    """An EndpointSlice that claims to be one of `service`'s, made by hand."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-by-hand",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    }


def test_the_router_sees_endpoints_appear_and_disappear_as_the_pool_scales(
    cluster: Cluster, namespace: str, router: ServerProcess
) -> None:
    # Whoever may write EndpointSlices cannot add a worker: only the EndpointSlice
    # controller's slices count (the rest of the test would see an extra decode worker).
    forged = json.dumps(hand_made_slice(f"{POOL}-decode", "10.254.0.9"))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=forged)

    def follows(decode: int, prefill: int) -> None:
        def same() -> bool:
            known = known_workers(router.url)
            found = {role: sorted(w["url"] for w in known[role]) for role in ("decode", "prefill")}
            pods = {role: ready_pod_urls(cluster, namespace, role) for role in found}
            return found == pods and (len(pods["decode"]), len(pods["prefill"])) == (
                decode,
                prefill,
            )

        wait_until(same, WAIT, f"the router to know {decode} decode and {prefill} prefill workers")

    follows(decode=2, prefill=1)
    apply(cluster, namespace, decode=3, prefill=1)
    follows(decode=3, prefill=1)
    apply(cluster, namespace, decode=1, prefill=1)
    follows(decode=1, prefill=1)
    # No prefill workers: their Deployment and Service go, and so do the slices.
    apply(cluster, namespace, decode=1, prefill=0)
    follows(decode=1, prefill=0)
    assert "10.254.0.9" not in json.dumps(known_workers(router.url))


def test_the_pool_gets_a_credential_secret_and_a_network_policy(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(cluster, namespace, decode=1, prefill=1)
    secret = wait_until(
        lambda: get_json(cluster, "secret", f"{POOL}-internal", "-n", namespace),
        WAIT, "the credential Secret",
    )  # fmt: skip
    pool = get_json(cluster, "servingpool", POOL, "-n", namespace)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32
    policy = wait_until(
        lambda: get_json(cluster, "networkpolicy", f"{POOL}-workers", "-n", namespace),
        WAIT, "the NetworkPolicy",
    )  # fmt: skip
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    for role in ("prefill", "decode", "router"):
        deployment = wait_until(
            partial(get_json, cluster, "deployment", f"{POOL}-{role}", "-n", namespace),
            WAIT, f"the {role} Deployment",
        )  # fmt: skip
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {
            "name": "credential",
            "secret": {"secretName": f"{POOL}-internal", "defaultMode": 288},
        } in volumes
    # The status records it; the operator never writes it again, nor shows its value,
    # and after a restart knows it as the pool's own (from the status: it cannot read it).
    recorded = {"name": f"{POOL}-internal", "uid": secret["metadata"]["uid"]}
    wait_until(  # (the Secret may come before the pool's first status)
        lambda: get_json(cluster, "servingpool", POOL, "-n", namespace).get("status", {}).get(
            "credentialSecret") == recorded,
        WAIT, "the status to record the Secret",
    )  # fmt: skip
    operator.restart()
    wait_until(  # the pool's resume, done
        lambda: operator.total("pdserve_operator_reconcile_duration_seconds_count") > 0,
        WAIT, "a reconcile",
    )  # fmt: skip
    again = get_json(cluster, "secret", f"{POOL}-internal", "-n", namespace)
    assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    status = get_json(cluster, "servingpool", POOL, "-n", namespace)["status"]
    assert all(c["reason"] != "SecretConflict" for c in status["conditions"]), status
    events = get_json(cluster, "events", "-n", namespace)
    assert all(token not in json.dumps(event) for event in events["items"])
