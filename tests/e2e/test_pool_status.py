"""The pool's status says why replicas are not ready, as the pods tell it: the real
kube-scheduler's reason for the example applied as a new user would (no GPU left:
tests/e2e/test_operator.py)."""

from __future__ import annotations

from typing import Any

import pytest

from support.operator import Cluster, OperatorProcess, wait_until
from support.pool_cluster import WAIT, apply_pool, get_pool
from support.pools import example

pytestmark = pytest.mark.cluster


def ready_condition(
    cluster: Cluster, namespace: str, name: str, reason: str, *fragments: str
) -> dict[str, Any]:
    """The Ready condition once it has `reason` and its message every fragment (the
    scheduler marks pods one by one)."""

    def found() -> dict[str, Any] | None:
        status = get_pool(cluster, namespace, name).get("status", {})
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
        if ready is None or ready["reason"] != reason:
            return None
        return ready if all(f in ready["message"] for f in fragments) else None

    return wait_until(found, WAIT, f"Ready ({reason}: {fragments}) on {namespace}/{name}")


def test_the_example_without_its_volume_claim_says_so(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    # As a new user would: the example applied as it is, its claim `models` not made.
    apply_pool(cluster, namespace, example("disaggregated"))
    each = ("prefill: 2 pods Unschedulable (", "decode: 4 pods Unschedulable (",
            "router: 1 pod Unschedulable (")  # fmt: skip
    ready = ready_condition(cluster, namespace, "llama-pd", "Unschedulable", *each)
    assert ready["status"] == "False"
    assert ready["message"].startswith("prefill 0/2, decode 0/4, router 0/1 ready: ")
    assert 'persistentvolumeclaim "models" not found' in ready["message"]
    assert get_pool(cluster, namespace, "llama-pd")["status"]["phase"] == "Pending"
