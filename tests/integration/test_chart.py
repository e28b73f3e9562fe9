"""The Helm chart with the project's own Helm: it lints, refuses bad values by name,
renders what each setting says, and deploy/ is its rendering (no cluster needed;
tests/e2e/test_chart.py installs it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import render_deploy
from render_deploy import (
    CHART,
    DEPLOY,
    ROOT,
    deploy_files,
    objects,
    run_helm,
    template,
    value_flags,
)

TOGGLES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "watching": {"watchNamespaces": ["team-a", "team-b"]},
    "clusterWide": {"rbac": {"namespaced": False}},
    "monitoring": {
        "prometheusNamespace": "monitoring",
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
        "grafanaDashboard": {"namespace": "monitoring", "annotations": {"grafana_folder": "x"}},
    },
    "bare": {
        "serviceAccount": {"create": False, "name": "existing"},
        "rbac": {"create": False, "namespaced": False},
        "service": {"enabled": False},
        "grafanaDashboard": {"enabled": False},
        "workerImage": {"repository": ""},
        "verbose": True,
    },
}


def kinds(rendered: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for obj in rendered:
        out.setdefault(obj["kind"], []).append(obj)
    return out


def operator_container(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = kinds(rendered)["Deployment"]
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("values", TOGGLES.values(), ids=TOGGLES.keys())
def test_chart_lints(values: dict[str, Any], tmp_path: Path) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(json.dumps(values))
    result = run_helm("lint", "--strict", str(CHART), "-f", str(values_file), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0': 'Team_A' does not match"),
        ({"alerts": {"ttftTargetSeconds": 2.5}}, "at '/alerts/ttftTargetSeconds': value must be"),
        ({"metricsPort": 0}, "at '/metricsPort': minimum: got 0, want 1"),
        ({"rbacc": {"create": True}}, "additional properties 'rbacc' not allowed"),
        ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of"),
        ({"prometheusNamespace": "Mon itoring"}, "at '/prometheusNamespace': 'Mon itoring' does"),
    ],
    ids=["namespace", "ttft-target", "port", "misspelt", "pull-policy", "prometheus-namespace"],
)
def test_bad_values_are_refused_by_name(values: dict[str, Any], message: str) -> None:
    result = run_helm("template", "x", str(CHART), *value_flags(values), check=False)
    assert result.returncode != 0
    assert message in result.stderr


def secret_verbs(role: dict[str, Any]) -> list[str]:
    (rule,) = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert rule["resources"] == ["secrets"] and rule["apiGroups"] == [""]
    verbs: list[str] = rule["verbs"]
    return verbs


def test_defaults_run_one_restricted_operator_in_its_own_namespace() -> None:
    rendered = objects(template())
    found = kinds(rendered)
    assert {k: len(v) for k, v in found.items()} == {
        "ServiceAccount": 1, "ConfigMap": 1, "Role": 1, "RoleBinding": 1,
        "Service": 1, "Deployment": 1,
    }  # fmt: skip
    # Nothing cluster-wide; the pools' credentials are created, no Secret is readable.
    assert all(obj["metadata"]["namespace"] == "pdserve-system" for obj in rendered)
    (role,) = found["Role"]
    assert secret_verbs(role) == ["create"]
    (deployment,) = found["Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "pdserve-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(rendered)
    assert container["image"] == "pdserve-operator:0.1.0"
    assert container["args"] == [
        "operator", "--namespace=pdserve-system", "--default-image=pdserve:0.1.0",
        "--metrics-port=8080",
    ]  # fmt: skip
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["resources"]["limits"]["memory"] == "512Mi"
    (binding,) = found["RoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pdserve-operator", "namespace": "pdserve-system"}
    ]


def test_the_cluster_wide_mode_watches_every_namespace_and_reads_no_secret() -> None:
    rendered = objects(template(TOGGLES["clusterWide"]))
    found = kinds(rendered)
    assert "Role" not in found and len(found["ClusterRoleBinding"]) == 1
    (role,) = found["ClusterRole"]
    assert secret_verbs(role) == ["create"]
    # kopf follows the CRD when it is installed after the operator.
    assert {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
            "verbs": ["list", "watch"]} in role["rules"]  # fmt: skip
    assert operator_container(rendered)["args"][:2] == ["operator", "--all-namespaces"]
    watching = objects(template({**TOGGLES["clusterWide"], "watchNamespaces": ["team-a"]}))
    assert operator_container(watching)["args"][:2] == ["operator", "--namespace=team-a"]


def test_namespaced_install_has_no_cluster_scope() -> None:
    rendered = objects(template(TOGGLES["watching"]))
    assert all("namespace" in obj["metadata"] for obj in rendered)
    found = kinds(rendered)
    assert sorted(r["metadata"]["namespace"] for r in found["Role"]) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in found["RoleBinding"]) == ["team-a", "team-b"]
    args = operator_container(rendered)["args"]
    assert args[:3] == ["operator", "--namespace=team-a", "--namespace=team-b"]
    # Without namespaces, the release's own.
    alone = objects(template(namespace="serving"))
    assert [r["metadata"]["namespace"] for r in kinds(alone)["Role"]] == ["serving"]
    assert "--namespace=serving" in operator_container(alone)["args"]


def test_monitoring_objects_follow_their_settings() -> None:
    rendered = objects(template(TOGGLES["monitoring"]))
    # The pools' NetworkPolicies admit the monitoring namespace (the operator's default).
    assert "--prometheus-namespace=monitoring" in operator_container(rendered)["args"]
    assert not any(a.startswith("--prometheus-namespace") for a in operator_container(
        objects(template()))["args"])  # fmt: skip
    found = kinds(rendered)
    (monitor,) = found["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    (rule,) = found["PrometheusRule"]
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert "PdserveITLP99AboveTarget" in alerts
    (dashboard,) = found["ConfigMap"]
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "files/grafana-dashboard.json").read_text())
    assert json.loads(dashboard["data"]["pdserve.json"]) == shipped


def test_bare_install_creates_only_the_operator() -> None:
    rendered = objects(template(TOGGLES["bare"]))
    assert [obj["kind"] for obj in rendered] == ["Deployment"]
    container = operator_container(rendered)
    assert not any(arg.startswith("--default-image") for arg in container["args"])
    assert "--verbose" in container["args"]
    pod = rendered[0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing"


def test_a_service_monitor_needs_the_service() -> None:
    values = {"serviceMonitor": {"enabled": True}, "service": {"enabled": False}}
    result = run_helm("template", "x", str(CHART), *value_flags(values), check=False)
    assert "serviceMonitor.enabled needs service.enabled" in result.stderr


def test_deploy_is_the_chart_rendered_with_defaults() -> None:
    for path, text in deploy_files().items():
        assert (DEPLOY / path).read_text() == text, f"deploy/{path} is stale: run `make deploy`"


def test_the_generator_reports_a_stale_deploy_file(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "render_deploy.py"
    env = {**os.environ, "HELM": str(render_deploy.helm())}
    fresh = subprocess.run([sys.executable, script, "--check"], env=env, capture_output=True)
    assert fresh.returncode == 0, fresh.stderr
    copy = tmp_path / "tree"
    for folder in ("charts", "deploy", "scripts"):
        shutil.copytree(ROOT / folder, copy / folder)
    (copy / "deploy" / "namespace.yaml").write_text("# edited by hand\n")
    stale = subprocess.run(
        [sys.executable, copy / "scripts" / "render_deploy.py", "--check"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert stale.returncode == 1
    assert "deploy/namespace.yaml is stale" in stale.stderr
