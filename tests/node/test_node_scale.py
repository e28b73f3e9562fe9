"""The operator at scale on the real node's control plane: tests/bench's 200 pools
(PDSERVE_BENCH_POOLS=2000 for more), their pods on a kwok node while the real node is
cordoned (thousands of real containers would not fit on this machine). `make bench-node`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from bench.test_operator_scale import READY_TIMEOUT, get_node
from bench.test_operator_scale import test_operator_scale as test_operator_scale_on_node

from pdserve.devcluster import DevCluster
from pdserve.devcluster.node import NodeCluster
from pdserve.devcluster.nodes import gpu_node, node_schedulable
from support.waiting import wait_until

# Creation and the resync each wait up to READY_TIMEOUT, the cluster's start besides.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(3600, int(3 * READY_TIMEOUT)))]
__all__ = ["test_operator_scale_on_node"]


@pytest.fixture(scope="module")
def cluster(node_cluster: NodeCluster) -> Iterator[DevCluster]:
    """The node's control plane, with a kwok node for the pools' pods."""
    control = node_cluster.control_plane
    node = gpu_node("kwok-bench-0", gpus=0, cpu="1000", memory="4Ti", pods=5000)
    control.kubectl("apply", "-f", "-", input=json.dumps(node))
    wait_until(lambda: node_schedulable(get_node(control, "kwok-bench-0")), 120, "bench node")
    control.kubectl("cordon", node_cluster.node_name)
    try:
        yield control
    finally:
        control.kubectl("delete", "namespace", "bench", "--wait=false")
        control.kubectl("uncordon", node_cluster.node_name)
