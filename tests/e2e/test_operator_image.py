"""The operator's container image: the control plane and nothing else, non-root,
small, and, run with podman against the real control plane, it reconciles a pool.

The image is built by scripts/build-images.sh (cached by the content it is built from;
a cold build takes minutes). The container runs on the host's network, since the
control plane listens on loopback, as the chart's ServiceAccount with a token.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.images import built_image, inspect, podman_run, remove_container, run_in
from support.operator import (
    Cluster,
    OperatorProcess,
    get_json,
    install_crd,
    operator_kubeconfig,
    wait_until,
)

pytestmark = pytest.mark.cluster

MAX_SIZE_BYTES = 300_000_000


@pytest.fixture(scope="module")
def image() -> str:
    return built_image("operator")


def test_the_image_holds_the_operator_only(image: str) -> None:
    found = run_in(
        image, "-c",
        "import importlib.util as u; print(sorted(m for m in "
        "('torch', 'nixl', 'pdserve.workers', 'kopf', 'pdserve.operator') if u.find_spec(m)))",
        entrypoint="python3",
    )  # fmt: skip
    assert found.strip() == "['kopf', 'pdserve.operator']"
    assert "pdserve-operator 0.1.0" in run_in(image, "version")
    assert inspect(image, "{{.Config.User}}") == "65532:65532"
    size = int(inspect(image, "{{.Size}}"))
    print(f"operator image: {size / 1e6:.0f} MB")
    assert size < MAX_SIZE_BYTES


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"image-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def test_the_image_reconciles_a_pool_to_ready(
    cluster: Cluster, image: str, namespace: str, tmp_path: Path
) -> None:
    install_crd(cluster)
    mount = tmp_path / "operator"
    mount.mkdir()
    kubeconfig = operator_kubeconfig(cluster, mount / "kubeconfig")
    name = f"pdserve-operator-{uuid.uuid4().hex[:6]}"
    operator = OperatorProcess(
        kubeconfig, mount / "operator.log", [namespace],
        pdserve=podman_run(image, name, mount), args=["--default-image=pdserve:0.1.0"],
    )  # fmt: skip
    try:
        operator.start(timeout=120)
        pool = {
            "apiVersion": "pdserve.dev/v1alpha1",
            "kind": "ServingPool",
            "metadata": {"name": "boxed"},
            "spec": {"model": {"name": "tiny", "path": "/models/tiny", "dtype": "float32"}},
        }
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))

        def ready() -> bool:
            status = get_json(cluster, "servingpool", "boxed", "-n", namespace).get("status", {})
            return bool(status.get("phase") == "Ready")

        wait_until(ready, 60, "the pool to turn Ready")
        decode = get_json(cluster, "deployment", "boxed-decode", "-n", namespace)
        assert decode["spec"]["template"]["spec"]["containers"][0]["image"] == "pdserve:0.1.0"
        assert operator.healthy()
    finally:
        operator.stop()
        print(f"--- operator log ---\n{operator.tail(40)}")
        remove_container(name)
