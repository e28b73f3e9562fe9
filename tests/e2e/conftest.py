"""End-to-end tests against a real local control plane (see pdserve.devcluster).

Every test in this folder is marked `cluster`. The session's first test starts the
cluster (building its binaries once if they are not cached: tens of minutes);
PDSERVE_CLUSTER_NO_BUILD=1 skips these tests instead of building.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.devcluster import DevCluster
from support.cluster import binaries_or_skip
from support.operator import (
    OperatorProcess,
    install_crd,
    operator_kubeconfig,
    running,
    wait_established,
)
from support.pool_cluster import SERVICE_MONITOR_CRD, make_namespace

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test collected from this folder `cluster`."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster() -> Iterator[DevCluster]:
    """A started DevCluster, shared by the whole session, stopped at its end."""
    binaries_or_skip()
    with DevCluster() as started:
        yield started


@pytest.fixture(scope="module")
def kubeconfig(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CRD installed, and a kubeconfig for the operator's own ServiceAccount."""
    install_crd(cluster)
    return operator_kubeconfig(cluster, tmp_path_factory.mktemp("operator") / "kubeconfig")


@pytest.fixture
def namespace(cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted (in the background) afterwards."""
    prefix = request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    name = make_namespace(cluster, prefix)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def operator(kubeconfig: Path, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator, watching the test's namespace only."""
    with running(OperatorProcess(kubeconfig, tmp_path / "operator.log", [namespace])) as process:
        yield process


@pytest.fixture
def service_monitors(cluster: DevCluster) -> Iterator[None]:
    """The cluster serves ServiceMonitors (a stand-in CRD, removed afterwards). Start the
    operator after this: it asks once, at start-up, whether they are served."""
    crd = "crd/" + SERVICE_MONITOR_CRD["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(SERVICE_MONITOR_CRD))
    try:
        wait_established(cluster, crd.removeprefix("crd/"))
        yield
    finally:
        cluster.kubectl("delete", crd, "--wait=true")
