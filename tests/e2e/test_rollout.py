"""Canary rollouts on a real control plane: a change to a canary pool runs beside the
stable revision with the router's split; an abort annotation restores the stable
revision; an operator restart resumes a rollout from its status.

The operator runs under the chart's ServiceAccount and RBAC (support.operator), with
no Prometheus: the analysis has no figures, so a rollout waits at its step (it is
never promoted on no evidence) and only the annotation moves it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.protocol import routing
from support.operator import Cluster, OperatorProcess, wait_until
from support.pool_cluster import (
    WAIT,
    apply_pool,
    children,
    events,
    get_pool,
    patch_pool,
    pool_manifest,
    wait_ready,
)

pytestmark = pytest.mark.cluster

POOL = "canary"
CANARY = {"type": "canary", "steps": [{"weight": 25, "analysisSeconds": 3600}, {"weight": 50}]}


def worker_deployments(cluster: Cluster, namespace: str) -> dict[str, dict[str, Any]]:
    """The pool's decode Deployments by name (those not being deleted)."""
    return {
        name: obj
        for (kind, name), obj in children(cluster, namespace, POOL).items()
        if kind == "Deployment"
        and obj["metadata"]["labels"].get("app.kubernetes.io/component") == "decode"
        and not obj["metadata"].get("deletionTimestamp")
    }


def split(cluster: Cluster, namespace: str) -> routing.Revisions:
    config = children(cluster, namespace, POOL)[("ConfigMap", f"{POOL}-routing")]
    return routing.parse_table(config["data"]["routing.json"].encode()).revisions


def flag(deployment: dict[str, Any], name: str) -> str:
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(name) + 1]


def rollout_of(cluster: Cluster, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = get_pool(cluster, namespace, POOL).get("status", {}).get("rollout", {})
    return found


def start_rollout(cluster: Cluster, namespace: str) -> tuple[str, str]:
    """A canary pool, Ready, then a change of its decode budget: (stable, canary)."""
    apply_pool(cluster, namespace, pool_manifest(POOL, decode={
        "replicas": 4, "rollout": CANARY,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "engine": {"maxNumBatchedTokens": 256, "maxNumSeqs": 16},
    }))  # fmt: skip
    wait_ready(cluster, namespace, POOL)
    stable = rollout_of(cluster, namespace)["decode"]["stableRevision"]
    assert set(worker_deployments(cluster, namespace)) == {f"{POOL}-{stable}"}
    patch_pool(cluster, namespace, POOL, {"decode": {"engine": {"maxNumBatchedTokens": 512}}})

    def started() -> str | None:
        decode = rollout_of(cluster, namespace).get("decode", {})
        return decode.get("canaryRevision") if decode.get("phase") == "Progressing" else None

    canary = wait_until(started, WAIT, "the rollout to start")
    return stable, canary


def test_a_change_runs_as_a_canary_and_an_abort_restores_the_stable_revision(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    stable, canary = start_rollout(cluster, namespace)
    assert canary != stable

    # Both revisions run: step 1 gives the canary 25% of 4 workers and of requests.
    def both() -> dict[str, dict[str, Any]] | None:
        found = worker_deployments(cluster, namespace)
        counts = {name: d["spec"]["replicas"] for name, d in found.items()}
        return found if counts == {f"{POOL}-{stable}": 3, f"{POOL}-{canary}": 1} else None

    found = wait_until(both, WAIT, "the stable and canary Deployments")
    assert flag(found[f"{POOL}-{stable}"], "--max-num-batched-tokens") == "256"
    assert flag(found[f"{POOL}-{stable}"], "--revision") == stable
    assert flag(found[f"{POOL}-{canary}"], "--max-num-batched-tokens") == "512"
    assert flag(found[f"{POOL}-{canary}"], "--revision") == canary
    template = found[f"{POOL}-{canary}"]["spec"]["template"]["metadata"]["labels"]
    assert template["pdserve.dev/revision"] == canary
    wanted = (
        routing.RevisionWeight(name=stable, weight=75),
        routing.RevisionWeight(name=canary, weight=25),
    )
    wait_until(lambda: split(cluster, namespace).decode == wanted, WAIT, "the router's split")
    # The Service selects the role: both revisions serve it.
    service = children(cluster, namespace, POOL)[("Service", f"{POOL}-decode")]
    assert "pdserve.dev/revision" not in service["spec"]["selector"]
    header, row = cluster.kubectl("get", "sp", POOL, "-n", namespace).stdout.splitlines()
    start = header.index("ROLLOUT")
    assert row[start:].split()[0] == "Progressing"
    # Events are posted apart from the status: one may show before the other.
    wait_until(
        lambda: "Started" in [reason for reason, _ in events(cluster, namespace, POOL)],
        WAIT,
        "a Started Event",
    )
    assert operator.total("pdserve_rollout_weight", revision=canary, role="decode") == 25
    assert operator.total("pdserve_rollout_step", pool=POOL, role="decode") == 1
    # No figures: the step waits for evidence, past any number of rounds.
    assert rollout_of(cluster, namespace)["decode"]["step"] == 0

    cluster.kubectl("annotate", "sp", POOL, "-n", namespace, "pdserve.dev/rollout=abort")

    def restored() -> bool:
        found = worker_deployments(cluster, namespace)
        counts = {name: d["spec"]["replicas"] for name, d in found.items()}
        return counts == {f"{POOL}-{stable}": 4} and split(cluster, namespace).decode == ()

    wait_until(restored, WAIT, "the stable revision alone, with every worker and request")
    decode = rollout_of(cluster, namespace)["decode"]
    assert decode["phase"] == "Aborted" and decode["lastDecision"]["reason"] == "ManualAbort"
    assert rollout_of(cluster, namespace)["phase"] == "Aborted"
    aborted = wait_until(
        lambda: [m for r, m in events(cluster, namespace, POOL) if r == "ManualAbort"],
        WAIT, "the abort's Event",
    )  # fmt: skip
    assert "decode: abort" in aborted[0]
    assert operator.total("pdserve_rollout_decisions_total", action="abort", role="decode") == 1
    assert operator.total("pdserve_rollout_weight", revision=stable, role="decode") == 100
    annotations = get_pool(cluster, namespace, POOL)["metadata"]["annotations"]
    assert annotations["pdserve.dev/rollout-acted"] == "abort"
    wait_ready(cluster, namespace, POOL, generation=2)
    # The refused revision does not start again while the spec still asks for it, once
    # the restarted operator has taken the pool up again (and not before: a check made
    # earlier would see the old operator's work only).
    operator.restart()
    wait_until(
        lambda: operator.total(
            "pdserve_operator_reconcile_duration_seconds_count", trigger="resume"
        ),
        WAIT,
        "the restarted operator to resume the pool",
    )
    wait_ready(cluster, namespace, POOL, generation=2)
    assert set(worker_deployments(cluster, namespace)) == {f"{POOL}-{stable}"}
    assert rollout_of(cluster, namespace)["decode"]["phase"] == "Aborted"


def test_a_restarted_operator_resumes_the_rollout_and_a_promote_acts_once(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    stable, canary = start_rollout(cluster, namespace)
    before = rollout_of(cluster, namespace)["decode"]
    operator.restart()
    cluster.kubectl("annotate", "sp", POOL, "-n", namespace, "pdserve.dev/rollout=promote")

    def promoted() -> dict[str, Any] | None:
        decode: dict[str, Any] = rollout_of(cluster, namespace)["decode"]
        return decode if decode["step"] == 1 else None

    decode = wait_until(promoted, WAIT, "the promotion to step 2")
    # Resumed from the status: the same revisions; the manual promote moved one step.
    assert (decode["stableRevision"], decode["canaryRevision"]) == (stable, canary)
    assert decode["lastDecision"]["reason"] == "ManualPromote"
    assert decode["stepStartedTime"] >= before["stepStartedTime"]

    def second_step() -> bool:
        counts = {
            n: d["spec"]["replicas"] for n, d in worker_deployments(cluster, namespace).items()
        }
        weights = [w.weight for w in split(cluster, namespace).decode]
        return counts == {f"{POOL}-{stable}": 2, f"{POOL}-{canary}": 2} and weights == [50, 50]

    wait_until(second_step, WAIT, "step 2's workers and split")
    # The annotation left in place is not acted on again.
    operator.restart()
    wait_until(lambda: operator.total("pdserve_rollout_step", role="decode") == 2, WAIT, "gauges")
    assert rollout_of(cluster, namespace)["decode"]["step"] == 1
    assert (
        json.loads(json.dumps(rollout_of(cluster, namespace)))["decode"]["phase"] == "Progressing"
    )
