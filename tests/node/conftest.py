"""Tests on a real node (pdserve.devcluster.node): the pods pdserve renders start in
containers under a kubelet, serve through a Service and hand KV over between pods.

Every test here is marked `cluster` and `node` (`make e2e-node`, `make bench-node`;
not in `make test`). They skip, saying why, where the machine cannot run a node (no
root, no cgroups); PDSERVE_CLUSTER_NO_BUILD=1 skips them instead of building the
node's binaries and images (tens of minutes, once).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.devcluster.binaries import BinariesError
from pdserve.devcluster.node import NodeCluster, unsupported_reason
from pdserve.devcluster.node.binaries import ensure_node_binaries
from support.cluster import binaries_or_skip
from support.images import built_image, podman

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test collected from this folder `cluster` and `node`."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.node)


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[NodeCluster]:
    """The control plane and a real node, shared by the session."""
    reason = unsupported_reason()
    if reason:
        pytest.skip(reason)
    build = os.environ.get("PDSERVE_CLUSTER_NO_BUILD") != "1"
    binaries_or_skip()
    try:
        ensure_node_binaries(build=build)
    except BinariesError as error:
        if build:
            raise
        pytest.skip(f"node binaries not built: {error}")
    with NodeCluster(build=build) as started:
        print(f"control plane and node up in {started.startup_seconds:.1f}s")
        yield started


@pytest.fixture(scope="session")
def node_images(
    node_cluster: NodeCluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The operator and worker images of `make images`, in the node's containerd."""
    scratch = tmp_path_factory.mktemp("images")
    store = node_cluster.images()
    references = {}
    for name in ("operator", "worker"):
        references[name] = built_image(name)
        store.load_from_podman(podman().parent, references[name], scratch)
    return references
