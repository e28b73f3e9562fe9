"""The control-plane binaries for tests that start a DevCluster."""

from __future__ import annotations

import os

import pytest

from pdserve.devcluster.binaries import BinariesError, ensure_binaries


def binaries_or_skip() -> None:
    """Build the binaries if missing (cached), or skip the test where
    PDSERVE_CLUSTER_NO_BUILD=1 and they are not there."""
    build = os.environ.get("PDSERVE_CLUSTER_NO_BUILD") != "1"
    try:
        ensure_binaries(build=build)
    except BinariesError as error:
        if build:
            raise
        pytest.skip(f"cluster binaries not built: {error}")
