"""The Helm chart on the real control plane: what it renders is accepted (every
setting; the operator's pod under the restricted Pod Security Standard), `helm
install` succeeds, and the operator, run with the chart's arguments under the chart's
ServiceAccount, reconciles a pool, with no more access than it needs: by default a
Role in each watched namespace, nothing outside them, and no Secret it may read.

kwok plays the kubelet, so the operator's Deployment turns Available without a
container running; the operator itself runs here as a process with a token of the
chart's ServiceAccount (the same identity the pod would have).
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from render_deploy import CHART, objects, run_helm, template, value_flags
from support.operator import (
    Cluster,
    OperatorProcess,
    account_kubeconfig,
    get_json,
    install_crd,
    wait_established,
    wait_until,
)

pytestmark = pytest.mark.cluster

WAIT = 60.0
MONITORING_KINDS = {"servicemonitors": "ServiceMonitor", "prometheusrules": "PrometheusRule"}
RESTRICTED = [f"pod-security.kubernetes.io/{m}=restricted" for m in ("enforce", "warn")]


def crd_of(plural: str, kind: str) -> dict[str, Any]:
    """A stand-in CRD of the Prometheus Operator (any content accepted)."""
    schema = {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"plural": plural, "kind": kind, "listKind": f"{kind}List"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": schema}],
        },
    }


def make_namespace(cluster: Cluster, prefix: str, *labels: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    if labels:
        cluster.kubectl("label", "namespace", name, *labels)
    return name


@pytest.fixture
def namespaces(cluster: Cluster) -> Iterator[list[str]]:
    """Namespaces a test makes (listed here), deleted afterwards."""
    made: list[str] = []
    yield made
    for name in made:
        cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="module")
def monitoring_crds(cluster: Cluster) -> Iterator[None]:
    """ServiceMonitor and PrometheusRule served for these tests only (the operator's
    tests check what happens without them)."""
    for plural, kind in MONITORING_KINDS.items():
        cluster.kubectl("apply", "-f", "-", input=json.dumps(crd_of(plural, kind)))
    for plural in MONITORING_KINDS:
        wait_established(cluster, f"{plural}.monitoring.coreos.com")
    yield
    for plural in MONITORING_KINDS:
        cluster.kubectl("delete", f"crd/{plural}.monitoring.coreos.com", "--wait=true")


def helm(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return run_helm(*args, "--kubeconfig", str(cluster.kubeconfig))


def can(cluster: Cluster, account: str, verb: str, resource: str, *where: str) -> bool:
    """Whether ServiceAccount `account` (namespace:name) may `verb` `resource`."""
    result = cluster.kubectl(
        "auth", "can-i", verb, resource, *where, f"--as=system:serviceaccount:{account}",
        check=False,
    )  # fmt: skip
    return result.stdout.strip() == "yes"


Question = tuple[str, ...]  # verb, resource, then where (`-n NS`, `--all-namespaces`)


def check_access(
    cluster: Cluster, account: str, allowed: Sequence[Question], refused: Sequence[Question]
) -> None:
    """`account` may do each of `allowed` and none of `refused`. The questions are asked
    at once: each is a kubectl process, and they do not depend on each other."""
    questions = [*allowed, *refused]
    with ThreadPoolExecutor(max_workers=8) as pool:
        found = pool.map(lambda q: can(cluster, account, *q), questions)
        answers = dict(zip(questions, found, strict=True))
    assert [q for q in allowed if not answers[q]] == [], "refused, should be allowed"
    assert [q for q in refused if answers[q]] == [], "allowed, should be refused"


def operator_of(deployment: dict[str, Any], kubeconfig: Path, log: Path) -> OperatorProcess:
    """The operator as the chart's Deployment runs it (its arguments; the metrics
    port chosen at bind here)."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = [a for a in container["args"] if a != "operator"]
    namespaces = [a.removeprefix("--namespace=") for a in args if a.startswith("--namespace=")]
    rest = [a for a in args if not a.startswith(("--namespace=", "--metrics-port="))]
    return OperatorProcess(kubeconfig, log, namespaces, args=rest)


def small_pool(name: str) -> dict[str, Any]:
    """A CPU pool that names no image: it gets the chart's worker image."""
    spec = {
        "model": {"name": "tiny-llama", "path": "/models/tiny-llama", "dtype": "float32"},
        "decode": {"replicas": 1, "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
    }
    return {
        "apiVersion": "pdserve.dev/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": name},
        "spec": spec,
    }


def wait_ready(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pool: dict[str, Any] = get_json(cluster, "servingpool", name, "-n", namespace)
        return pool if pool.get("status", {}).get("phase") == "Ready" else None

    return wait_until(ready, WAIT, f"ServingPool {namespace}/{name} Ready")


VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "clusterWide": {"rbac": {"namespaced": False}},
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "prometheusRule": {"enabled": True},
        "prometheusNamespace": "monitoring",
        "verbose": True,
        "serviceAccount": {"name": "custom-operator"},
    },
    "bare": {
        "serviceAccount": {"create": False, "name": "default"},
        "rbac": {"create": False, "namespaced": False},
        "service": {"enabled": False},
        "grafanaDashboard": {"enabled": False},
        "workerImage": {"repository": ""},
    },
}


@pytest.mark.usefixtures("monitoring_crds")
@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_setting_renders_objects_the_api_server_accepts(
    cluster: Cluster, namespaces: list[str], values: dict[str, Any]
) -> None:
    install_crd(cluster)
    release_ns = make_namespace(cluster, "chart", *RESTRICTED)
    watched = make_namespace(cluster, "chart-watched")
    namespaces += [release_ns, watched]
    if values.get("rbac", {}).get("namespaced", True):
        values = {**values, "watchNamespaces": [release_ns, watched]}
    rendered = template(values, namespace=release_ns, release=f"r{uuid.uuid4().hex[:6]}")
    applied = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    assert "Warning" not in applied.stderr, applied.stderr
    # The operator's pod is allowed where the restricted Pod Security Standard is
    # enforced (a Deployment is admitted either way; its pods would not be).
    (deployment,) = [o for o in objects(rendered) if o["kind"] == "Deployment"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "operator-pod", "namespace": release_ns},
        # The dry run created no ServiceAccount; the pod's security is what is checked.
        "spec": {**deployment["spec"]["template"]["spec"], "serviceAccountName": "default"},
    }
    admitted = cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False
    )
    assert admitted.returncode == 0 and "Warning" not in admitted.stderr, admitted.stderr


def test_helm_install_then_the_operator_reconciles_under_the_charts_identity(
    cluster: Cluster, namespaces: list[str], tmp_path: Path
) -> None:
    install_crd(cluster)
    release_ns = make_namespace(cluster, "pdserve", *RESTRICTED)
    pools_ns, other_ns = make_namespace(cluster, "pools"), make_namespace(cluster, "other")
    namespaces += [release_ns, pools_ns, other_ns]
    started = time.monotonic()
    helm(
        cluster, "install", "pdserve", str(CHART), "--namespace", release_ns,
        "--wait", "--timeout", "2m", *value_flags({"watchNamespaces": [pools_ns]}),
    )  # fmt: skip
    try:
        # Nothing cluster-wide (the operator's tests hold a ClusterRole of this name).
        manifest = objects(helm(cluster, "get", "manifest", "pdserve", "-n", release_ns).stdout)
        kinds = {obj["kind"] for obj in manifest}
        assert {"Role", "RoleBinding"} <= kinds and not kinds & {
            "ClusterRole",
            "ClusterRoleBinding",
        }
        check_the_charts_identity(cluster, release_ns, pools_ns, other_ns, started, tmp_path)
    finally:
        helm(cluster, "uninstall", "pdserve", "--namespace", release_ns, "--wait")


def check_the_charts_identity(
    cluster: Cluster, release_ns: str, pools_ns: str, other_ns: str, started: float,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The installed operator reconciles a pool as the chart's ServiceAccount, which
    may do what the operator does and nothing more."""
    deployment = get_json(cluster, "deployment", "pdserve-operator", "-n", release_ns)
    assert deployment["status"]["availableReplicas"] == 1
    account = f"{release_ns}:pdserve-operator"
    kubeconfig = account_kubeconfig(cluster, release_ns, "pdserve-operator", tmp_path / "kc")
    operator = operator_of(deployment, kubeconfig, tmp_path / "operator.log").start()
    try:
        for ns in (pools_ns, other_ns):
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(small_pool("chat")))
        pool = wait_ready(cluster, pools_ns, "chat")
        seconds = time.monotonic() - started
        print(f"helm install to pool Ready: {seconds:.1f}s")
        decode = get_json(cluster, "deployment", "chat-decode", "-n", pools_ns)
        (container,) = decode["spec"]["template"]["spec"]["containers"]
        assert container["image"] == "pdserve:0.1.0"  # the chart's workerImage
        assert pool["status"]["decode"]["readyReplicas"] == 1
        assert pool["status"]["credentialSecret"]["name"] == "chat-internal"
        log = operator.tail(400)
        # kopf needs no cluster-wide access for named namespaces, and asks for none.
        assert "Not enough permissions" not in log and "Forbidden" not in log, log
        assert "status" not in get_json(cluster, "servingpool", "chat", "-n", other_ns)
    finally:
        operator.stop()
        print(f"--- operator log ---\n{operator.tail(60)}")
    # Enough, and no more: what the operator does is allowed, the rest refused.
    allowed = [
        ("patch", "deployments"), ("delete", "services"), ("patch", "servingpools/status"),
        ("create", "roles"), ("watch", "endpointslices.discovery.k8s.io"),
        ("create", "networkpolicies.networking.k8s.io"),
        ("create", "secrets"),  # the pool's credential, made once
    ]  # fmt: skip
    refused = [
        ("get", "secrets"), ("list", "secrets"), ("watch", "secrets"), ("patch", "secrets"),
        ("update", "secrets"), ("delete", "secrets"),
        ("create", "pods"), ("create", "servingpools"), ("delete", "servingpools"),
        ("update", "deployments"), ("escalate", "roles"),
        ("bind", "clusterroles"), ("create", "clusterroles"), ("list", "nodes"),
        ("delete", "customresourcedefinitions"), ("impersonate", "serviceaccounts"),
    ]  # fmt: skip
    check_access(
        cluster,
        account,
        [(verb, resource, "-n", pools_ns) for verb, resource in allowed],
        [(verb, resource, "-n", pools_ns) for verb, resource in refused]
        + [
            ("list", "deployments", "-n", other_ns),
            ("list", "servingpools", "--all-namespaces"),
            ("list", "namespaces"),
            ("watch", "customresourcedefinitions"),
        ],
    )
    check_no_secret_is_readable(cluster, account, pools_ns, "chat-internal")


def check_no_secret_is_readable(cluster: Cluster, account: str, namespace: str, own: str) -> None:
    """Neither a Secret someone else made nor the pool's own credential can be read by
    the operator's account (it only ever creates Secrets)."""
    foreign = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "foreign"},
               "stringData": {"password": "hunter2"}}  # fmt: skip
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(foreign))
    refused_verbs = [
        (verb, f"secret/{name}", "-n", namespace)
        for name in ("foreign", own)
        for verb in ("get", "patch", "delete")
    ]
    check_access(cluster, account, [], refused_verbs)
    refused = cluster.kubectl(
        "get", "secret", "foreign", "-n", namespace, f"--as=system:serviceaccount:{account}",
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "Forbidden" in refused.stderr, refused.stderr


def test_the_cluster_wide_mode_reaches_every_namespace_and_still_no_secret(
    cluster: Cluster, namespaces: list[str], tmp_path: Path
) -> None:
    install_crd(cluster)
    release_ns = make_namespace(cluster, "pdserve-cw", *RESTRICTED)
    pools_ns = make_namespace(cluster, "pools")
    namespaces += [release_ns, pools_ns]
    release = f"cw{uuid.uuid4().hex[:6]}"
    helm(cluster, "install", release, str(CHART), "--namespace", release_ns, "--wait",
         *value_flags({"rbac": {"namespaced": False}}))  # fmt: skip
    name = f"{release}-pdserve-operator"
    try:
        account = f"{release_ns}:{name}"
        deployment = get_json(cluster, "deployment", name, "-n", release_ns)
        assert "--all-namespaces" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        kubeconfig = account_kubeconfig(cluster, release_ns, name, tmp_path / "kc")
        operator = operator_of(deployment, kubeconfig, tmp_path / "operator.log").start()
        try:
            pool = json.dumps(small_pool("rag"))
            cluster.kubectl("apply", "-n", pools_ns, "-f", "-", input=pool)
            wait_ready(cluster, pools_ns, "rag")
            # No request refused for want of a permission (pools of other tests, in
            # namespaces being deleted, have writes refused for that reason).
            log = operator.tail(400)
            assert "is forbidden: User" not in log and "Not enough permissions" not in log, log
        finally:
            operator.stop()
        # kopf watches pools and children cluster-wide and follows the CRD (installed
        # before or after it).
        check_access(
            cluster,
            account,
            [
                *[
                    ("watch", resource, "--all-namespaces")
                    for resource in ("servingpools", "deployments", "configmaps")
                ],
                ("watch", "customresourcedefinitions"),
                ("create", "secrets", "-n", pools_ns),
            ],
            [
                ("list", "namespaces"),
                *[
                    (verb, "secrets", "--all-namespaces")
                    for verb in ("get", "list", "watch", "patch", "delete")
                ],
            ],
        )
        check_no_secret_is_readable(cluster, account, pools_ns, "rag-internal")
    finally:  # the ClusterRole and its binding are cluster-wide: never left behind
        helm(cluster, "uninstall", release, "--namespace", release_ns, "--wait")
    assert get_json(cluster, "clusterrole", name) is None
