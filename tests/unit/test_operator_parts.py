"""The operator's small parts: resource paths, kopf settings, the command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from pdserve.cli.main import build_parser
from pdserve.operator import api, render
from pdserve.operator.controller import handlers, kube
from pdserve.operator.controller.cache import cached_copy

ROOT = Path(__file__).resolve().parents[2]


def test_paths_of_core_and_group_kinds() -> None:
    assert kube.CONFIG_MAP.path("ns") == "/api/v1/namespaces/ns/configmaps"
    assert kube.DEPLOYMENT.path("ns", "d") == "/apis/apps/v1/namespaces/ns/deployments/d"
    assert kube.SERVING_POOL.path("ns", "p") == (
        "/apis/pdserve.dev/v1alpha1/namespaces/ns/servingpools/p"
    )
    assert (kube.ROLE.group, kube.ROLE.version) == ("rbac.authorization.k8s.io", "v1")
    assert (kube.SERVICE.group, kube.SERVICE.version) == ("", "v1")


WRITTEN_KINDS = [k for k in (*kube.WATCHED_KINDS, *kube.OPTIONAL_KINDS) if k != kube.POD]


def test_the_operator_knows_every_kind_render_makes() -> None:
    manifest = yaml.safe_load((ROOT / "deploy/examples/disaggregated.yaml").read_text())
    kinds = set()
    for scaler in ("planner", "hpa", "keda"):
        manifest["spec"]["autoscaling"]["policy"] = {"type": scaler}
        spec = api.parse_spec(manifest["spec"])
        objects = render.render("p", "ns", spec, prometheus_url="http://prometheus:9090")
        kinds |= {obj["kind"] for obj in objects}
    assert kinds == {k.kind for k in WRITTEN_KINDS}


def test_the_rbac_manifest_grants_every_kind_the_operator_writes() -> None:
    documents = list(yaml.safe_load_all((ROOT / "deploy/operator/rbac.yaml").read_text()))
    # The default install: a Role in the watched namespace, no cluster-wide access.
    assert {d["kind"] for d in documents} == {"Role", "RoleBinding"}
    (role,) = [d for d in documents if d["kind"] == "Role"]
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    for kind in WRITTEN_KINDS:
        verbs = granted[(kind.group, kind.plural)]
        assert {"list", "watch", "patch", "delete"} <= verbs, kind
    assert granted[("", "pods")] == {"get", "list", "watch"}
    assert {"patch"} <= granted[("pdserve.dev", "servingpools/status")]
    # The routers' Role grants these; only a holder may grant them.
    assert {"get", "list", "watch"} <= granted[("discovery.k8s.io", "endpointslices")]
    # The pools' credentials are created, never read, changed or adopted.
    assert granted[("", "secrets")] == {"create"}


def test_kopf_keeps_its_bookkeeping_out_of_the_status() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.posting.level == logging.WARNING
    selectors = dict(settings.watching.label_selectors.items())
    assert len(selectors) == len(kube.WATCHED_KINDS)
    assert set(selectors.values()) == {render.POOL_LABEL}


@pytest.mark.parametrize(
    ("namespaces", "scanning"),
    [((), True), (("a", "b"), False), (("team-*",), True), (("!kube-system",), True)],
    ids=["all", "named", "pattern", "negation"],
)
def test_named_namespaces_need_no_cluster_wide_observation(
    namespaces: tuple[str, ...], scanning: bool
) -> None:
    # kopf lists namespaces and watches CRDs (cluster-scoped) only when it must: a
    # namespaced install grants neither.
    settings = kopf.OperatorSettings()
    handlers.configure(settings, namespaces)
    assert settings.scanning.disabled is not scanning


def test_cached_copies_drop_managed_fields() -> None:
    body: dict[str, Any] = {
        "kind": "Deployment",
        "metadata": {"name": "d", "managedFields": [{}]},
        "spec": {},
    }
    copied = cached_copy(body)
    assert copied["metadata"] == {"name": "d"}
    assert body["metadata"]["managedFields"] == [{}]


def test_token_credentials_from_a_kubeconfig(tmp_path: Path) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": "https://127.0.0.1:6443/", "insecure-skip-tls-verify": True},
            }
        ],
        "users": [{"name": "u", "user": {"token": "abc"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    credentials = kube.load_credentials(path)
    assert credentials.server == "https://127.0.0.1:6443"
    assert credentials.ssl_context is False
    assert credentials.headers() == {"authorization": "Bearer abc"}
    assert credentials.token() == ("Bearer", "abc")
    assert credentials.files() == (None, None, None)


def test_operator_command_line() -> None:
    args = build_parser().parse_args(
        ["operator", "-n", "a", "--namespace", "b", "--metrics-port", "0"]
    )
    assert args.namespace == ["a", "b"] and args.metrics_port == 0
    assert build_parser().parse_args(["operator"]).namespace == []
    assert build_parser().parse_args(["operator"]).resync_interval == 300.0
    resync = build_parser().parse_args(["operator", "--resync-interval", "2.5"]).resync_interval
    assert resync == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--resync-interval", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "-A", "-n", "a"])
