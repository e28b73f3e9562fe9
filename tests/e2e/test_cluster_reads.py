"""The tests' in-process reads of the cluster (support.apiserver) print what
`kubectl get -o json` prints, for every form the tests poll with, and leave the rest
to kubectl."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.devcluster import DevCluster
from support import apiserver
from support.operator import install_crd
from support.pool_cluster import CHILD_KINDS, apply_pool, pool_manifest

pytestmark = pytest.mark.cluster


def by_kubectl(cluster: DevCluster, *args: str) -> Any:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        assert "NotFound" in result.stderr, result.stderr
        return None
    return json.loads(result.stdout)


def test_in_process_reads_match_kubectl(cluster: DevCluster, namespace: str) -> None:
    install_crd(cluster)
    apply_pool(cluster, namespace, pool_manifest("read"))
    cluster.kubectl("create", "configmap", "x", "-n", namespace, "--from-literal=a=b")
    cluster.kubectl("create", "deployment", "d", "-n", namespace, "--image=example:1")
    forms = [
        ("servingpool", "read", "-n", namespace),
        ("sp", "read", "-n", namespace),
        ("servingpool", "missing", "-n", namespace),
        ("configmap", "x", "-n", namespace),
        ("deployments,configmaps", "-n", namespace),
        (CHILD_KINDS, "-n", namespace, "-l", "app=d"),
        ("replicasets,pods", "-n", namespace, "-l", "app=d"),
        ("events", "-n", namespace, "--field-selector", "involvedObject.kind=Deployment"),
        ("namespace", namespace),
        ("node", cluster.node_name),
        ("crd", "servingpools.pdserve.dev"),
        ("clusterrole", "missing"),
    ]
    client = apiserver.client(cluster.kubeconfig)
    assert client is not None
    for form in forms:
        get = apiserver.parse(form)
        assert get is not None, form
        # A controller may write between the two reads (the Deployment's status, an
        # Event): both are read again, up to three times.
        for _ in range(3):
            mine = client.read(get)
            if mine == by_kubectl(cluster, *form):
                break
        else:
            raise AssertionError(f"{form}: the in-process read differs from kubectl's")
    # Forms the tests do not poll with are kubectl's.
    assert apiserver.parse(["pods", "-A"]) is None
    assert apiserver.parse(["widgets.example.com", "w1"]) is None
    assert apiserver.parse(["pod", "p", "-l", "app=d"]) is None
