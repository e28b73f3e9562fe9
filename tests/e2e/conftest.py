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
