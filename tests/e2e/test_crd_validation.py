"""The ServingPool CRD on a real API server: accepted, defaulting, refusing bad pools.

Every invalid pool of tests/data/invalid-servingpools.yaml must be refused by the API
server itself (OpenAPI bounds, enums and CEL rules), with an error naming the field,
just as pydantic refuses it in tests/unit/test_api.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import yaml

from pdserve.operator import api, render
from support.operator import wait_established
from support.pools import EXAMPLES, INVALID_CASES, ROOT, example, merged

pytestmark = pytest.mark.cluster

CASES = INVALID_CASES
NAMESPACE = "crd-validation"
CRD_NAME = "servingpools.pdserve.dev"


class Cluster(Protocol):
    """The part of the session's `cluster` fixture these tests use."""

    @property
    def kubeconfig(self) -> Path: ...

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]: ...


@pytest.fixture(scope="module")
def crd_ready(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with the CRD installed and established, and a namespace for pools.

    The CRD stays (other tests use it); the pools made here are deleted afterwards.
    """
    applied = cluster.kubectl(
        "apply", "--server-side", "-f", str(ROOT / "charts" / "pdserve" / "crds")
    )
    assert "Warning" not in applied.stderr, applied.stderr
    wait_established(cluster, CRD_NAME)
    if cluster.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", NAMESPACE)
    yield cluster
    cluster.kubectl("delete", "servingpools", "--all", "-n", NAMESPACE, "--wait=false")


def get_pool(cluster: Cluster, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "servingpool", name, "-n", NAMESPACE, "-o", "json").stdout
    pool: dict[str, Any] = json.loads(out)
    return pool


def columns(header: str, row: str) -> dict[str, str]:
    """A row of `kubectl get` output by column name (empty cells stay empty)."""
    starts = [header.index(name) for name in header.split()]
    ends = [*starts[1:], None]
    return {
        name: row[start:end].strip()
        for name, start, end in zip(header.split(), starts, ends, strict=True)
    }


def test_examples_are_accepted_and_defaulted(crd_ready: Cluster) -> None:
    applied = crd_ready.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES))
    assert "Warning" not in applied.stderr, applied.stderr
    tiny = get_pool(crd_ready, "tiny")["spec"]
    # Defaults come from the schema: the stored object is complete.
    assert tiny["kvTransfer"] == {"backend": "nixl", "failurePolicy": "recompute"}
    assert tiny["kvCache"] == {"blockSize": 16, "dtype": "auto"}
    assert tiny["router"]["replicas"] == 1
    assert tiny["autoscaling"]["policy"]["intervalSeconds"] == 30
    assert tiny["decode"]["engine"]["maxNumBatchedTokens"] == 256
    assert "prefill" not in tiny
    pd = get_pool(crd_ready, "llama-pd")["spec"]
    assert pd["routing"]["buckets"][1] == {"mode": "disaggregated"}
    # What the operator reads back (defaults filled in) is what the models make of it.
    for name, stored in (("tiny-colocated", tiny), ("disaggregated", pd)):
        assert api.parse_spec(stored) == api.parse_pool(example(name)).spec


def test_status_written_by_the_models_is_accepted(crd_ready: Cluster) -> None:
    crd_ready.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES / "disaggregated.yaml"))
    conditions = api.with_condition((), "Ready", "False", "WaitingForWorkers", "1/4 decode ready")
    conditions = api.with_condition(conditions, "Progressing", "True", "RollingOut", generation=1)
    status = api.ServingPoolStatus(
        observed_generation=1,
        phase="Progressing",
        conditions=conditions,
        prefill=api.RoleStatus(desired_replicas=2, ready_replicas=2),
        decode=api.RoleStatus(desired_replicas=4, ready_replicas=1),
        router_endpoint="http://llama-pd-router.crd-validation.svc:8000",
    )
    patch = ["--subresource=status", "--type=merge", "-p", json.dumps({"status": api.dump(status)})]
    crd_ready.kubectl("patch", "sp", "llama-pd", "-n", NAMESPACE, *patch)
    stored = api.ServingPoolStatus.model_validate(get_pool(crd_ready, "llama-pd")["status"])
    assert stored == status


def test_short_name_and_printer_columns(crd_ready: Cluster) -> None:
    crd_ready.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES / "tiny-colocated.yaml"))
    status = {
        "status": {
            "phase": "Progressing",
            "decode": {"desiredReplicas": 2, "readyReplicas": 1, "summary": "1/2"},
            "routerEndpoint": "http://tiny-router.crd-validation.svc:8000",
        }
    }
    patch = ["--subresource=status", "--type=merge", "-p", json.dumps(status)]
    crd_ready.kubectl("patch", "sp", "tiny", "-n", NAMESPACE, *patch)
    header, row = crd_ready.kubectl("get", "sp", "tiny", "-n", NAMESPACE).stdout.splitlines()
    assert header.split() == ["NAME", "MODEL", "PREFILL", "DECODE", "PHASE", "ROLLOUT", "AGE"]
    assert columns(header, row) == {
        "NAME": "tiny",
        "MODEL": "tiny-llama",
        "PREFILL": "",  # a colocated pool has no prefill workers
        "DECODE": "1/2",
        "PHASE": "Progressing",
        "ROLLOUT": "",  # no rollout yet
        "AGE": columns(header, row)["AGE"],
    }
    # The status subresource keeps spec writes from touching status and vice versa.
    assert get_pool(crd_ready, "tiny")["status"]["decode"]["readyReplicas"] == 1


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_api_server_refuses_invalid_pool(
    crd_ready: Cluster, tmp_path: Path, case: dict[str, Any]
) -> None:
    manifest = merged(example(case["base"]), case["patch"])
    if "metadata" not in case["patch"]:
        manifest["metadata"]["name"] = "invalid"
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(manifest))
    # A server-side dry run goes through the whole validation and stores nothing.
    result = crd_ready.kubectl(
        "create", "--dry-run=server", "-n", NAMESPACE, "-f", str(path), check=False
    )
    assert result.returncode != 0, f"accepted: {case['case']}"
    lines = result.stderr.replace(", spec.", "\nspec.").splitlines()
    assert any(case["field"] in line and case["message"] in line for line in lines), result.stderr


def test_each_example_passes_the_same_dry_run(crd_ready: Cluster, tmp_path: Path) -> None:
    # The valid counterpart of the refusals above, with the same command.
    for source in sorted(EXAMPLES.glob("*.yaml")):
        manifest = yaml.safe_load(source.read_text())
        manifest["metadata"]["name"] = "valid"
        path = tmp_path / source.name
        path.write_text(yaml.safe_dump(manifest))
        crd_ready.kubectl("create", "--dry-run=server", "-n", NAMESPACE, "-f", str(path))


@pytest.mark.parametrize("name", ["tiny-colocated", "disaggregated"])
def test_rendered_objects_pass_a_server_side_dry_run(
    crd_ready: Cluster, tmp_path: Path, name: str
) -> None:
    # What the handlers will apply must be valid Kubernetes objects (the ServiceMonitor
    # needs the Prometheus Operator's CRD, which this cluster does not have).
    pool = api.parse_pool(example(name))
    objects = render.render(pool.metadata.name, NAMESPACE, pool.spec)
    items = [o for o in objects if o["kind"] != "ServiceMonitor"]
    path = tmp_path / "objects.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    applied = crd_ready.kubectl(
        "apply", "--server-side", "--field-manager=pdserve", "--dry-run=server", "-f", str(path)
    )
    assert applied.stdout.count("serverside-applied") == len(items), applied.stdout
