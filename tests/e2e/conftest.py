"""End-to-end tests against a real local control plane (see pdserve.devcluster).

Every test in this folder is marked `cluster`. The session's first test starts the
cluster (building its binaries once if they are not cached: tens of minutes);
PDSERVE_CLUSTER_NO_BUILD=1 skips these tests instead of building.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.devcluster import DevCluster
from support.cluster import binaries_or_skip
from support.operator import (
    Cluster,
    OperatorProcess,
    install_crd,
    make_namespace,
    operator_kubeconfig,
)

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
def kubeconfig(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CRD installed, and a kubeconfig for the operator's own ServiceAccount."""
    install_crd(cluster)
    return operator_kubeconfig(cluster, tmp_path_factory.mktemp("operator") / "kubeconfig")


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted (in the background) afterwards."""
    prefix = request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    name = make_namespace(cluster, prefix)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def operator(kubeconfig: Path, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator, watching the test's namespace only."""
    process = OperatorProcess(kubeconfig, tmp_path / "operator.log", [namespace]).start()
    yield process
    process.stop()
    print(f"--- operator log ---\n{process.tail(80)}")
