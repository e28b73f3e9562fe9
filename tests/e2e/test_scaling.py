"""Autoscaling on the real control plane, reading a real Prometheus.

kwok plays the kubelet, so the pool's pods run no worker: the metrics come from a
real worker process on this machine, started with the pool's name, that a real
Prometheus scrapes (adding the test's namespace as a label, as a ServiceMonitor
does). An injected stall on every engine step makes its inter-token latency break
the pool's SLO however fast the machine is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.workers.faults import Fault
from support.load import load
from support.network import refusing_url
from support.operator import (
    Cluster,
    OperatorProcess,
    get_json,
    running,
    wait_established,
    wait_until,
)
from support.pool_cluster import (
    apply_pool,
    condition,
    events,
    get_pool,
    pool_manifest,
)
from support.prometheus import host_port, running_prometheus
from support.tools import _script_output
from support.worker import ServerProcess, running_worker

pytestmark = pytest.mark.cluster

STALL_S = 0.25  # every engine step of the worker: ITL never below it
ITL_TARGET_S = 0.1
WAIT = 120.0


def autoscaled(name: str, **policy: Any) -> dict[str, Any]:
    """A pool whose decode workers the planner scales (1 to 3) on ITL, deciding every
    second over a 10-second window."""
    manifest = pool_manifest(
        name,
        slo={"itl": {"seconds": ITL_TARGET_S, "percentile": 50}},
        autoscaling={
            "enabled": True,
            "decode": {"minReplicas": 1, "maxReplicas": 3},
            "policy": {
                "intervalSeconds": 1, "windowSeconds": 10, "minRequests": 2,
                "cooldownSeconds": 0, "maxScaleUpStep": 1,
                "scaleDownStabilizationSeconds": 3600, **policy,
            },
        },
    )  # fmt: skip
    manifest["spec"]["decode"]["replicas"] = 1
    return manifest


def replicas(cluster: Cluster, namespace: str, deployment: str) -> int | None:
    found = get_json(cluster, "deployment", deployment, "-n", namespace)
    return None if found is None else int(found["spec"].get("replicas", 0))


def ready_replicas(cluster: Cluster, namespace: str, pool: str, role: str) -> int:
    status = get_pool(cluster, namespace, pool).get("status", {})
    return int(status.get(role, {}).get("readyReplicas", 0))


def condition_of(cluster: Cluster, namespace: str, pool: str, type_: str) -> dict[str, Any] | None:
    status = get_pool(cluster, namespace, pool).get("status", {})
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def wait_condition(
    cluster: Cluster, namespace: str, pool: str, type_: str, status: str, reason: str
) -> dict[str, Any]:
    def matches() -> dict[str, Any] | None:
        found = condition_of(cluster, namespace, pool, type_)
        return found if found and (found["status"], found["reason"]) == (status, reason) else None

    return wait_until(matches, WAIT, f"{type_}={status} ({reason}) on {namespace}/{pool}")


@pytest.fixture
def slow_worker(small_model_dir: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """A worker of pool `chat` whose every engine step stalls."""
    stall = {"engine.step": Fault(delay_s=STALL_S)}
    args = ("--pool", "chat", "--served-model-name", "tiny-llama")
    with running_worker(small_model_dir, tmp_path, *args, faults=stall) as worker:
        yield worker


def test_planner_decisions_from_prometheus_reach_the_deployment_and_the_status(
    cluster: Cluster, kubeconfig: Path, namespace: str, slow_worker: ServerProcess, tmp_path: Path
) -> None:
    labels = {"namespace": namespace}
    with running_prometheus(
        tmp_path / "prometheus", [host_port(slow_worker.url)], labels=labels
    ) as prometheus:
        args = ["--prometheus-url", prometheus.url]
        operator = OperatorProcess(kubeconfig, tmp_path / "operator.log", [namespace], args=args)
        with running(operator):
            apply_pool(cluster, namespace, autoscaled("chat"))
            assert (
                wait_until(
                    lambda: replicas(cluster, namespace, "chat-decode"), WAIT, "the Deployment"
                )
                == 1
            )
            with load(slow_worker.url, "tiny-llama", clients=2, prompt="hello", max_tokens=4):
                wait_until(
                    lambda: (replicas(cluster, namespace, "chat-decode") or 0) >= 2, WAIT,
                    "the planner to add a decode worker",
                )  # fmt: skip
                # Read while the load lasts: once it ends, a later round may record why
                # it holds (too few requests) over why it scaled.
                pool = get_pool(cluster, namespace, "chat")
            decided = pool["status"]["autoscaling"]
            assert decided["decode"]["replicas"] >= 2
            # Under the load the planner goes on adding workers up to maxReplicas (3), or
            # holds while the worker it added starts (slow on a loaded machine); why it
            # scaled up is the ScaledUp Event's, checked below.
            reasons = ("ITLAboveTarget", "AtMaxReplicas", "WaitingForReplicas")
            assert decided["decode"]["reason"] in reasons
            assert decided["decode"]["lastScaleTime"]
            assert decided["inputs"]["itlSeconds"] >= STALL_S
            assert condition(pool, "ScalingActive")["status"] == "True"
            # The status counts what the planner wants, and kwok makes it ready.
            wait_until(
                lambda: ready_replicas(cluster, namespace, "chat", "decode") >= 2, WAIT,
                "the new decode worker ready",
            )  # fmt: skip

            # Events are posted apart from the status: one may show after it.
            def scaled_up() -> list[str] | None:
                scaled = [m for r, m in events(cluster, namespace, "chat") if r == "ScaledUp"]
                wanted = "decode 1 -> 2: ITLAboveTarget: ITL p50"
                return scaled if any(m.startswith(wanted) for m in scaled) else None

            wait_until(scaled_up, WAIT, "a ScaledUp Event for decode 1 -> 2 on ITL p50")
            up = operator.total(
                "pdserve_operator_scaling_decisions_total", role="decode", direction="up"
            )
            assert up >= 1


def test_without_usable_metrics_nothing_scales_and_conditions_say_why(
    cluster: Cluster, kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    with refusing_url() as nowhere, running_prometheus(tmp_path / "prometheus") as empty:
        operator = OperatorProcess(
            kubeconfig, tmp_path / "operator.log", [namespace], args=["--prometheus-url", nowhere]
        )
        unreachable = autoscaled("unreachable")
        unreachable["spec"]["decode"]["replicas"] = 2
        no_data = autoscaled("nodata", prometheusUrl=empty.url)
        no_data["spec"]["decode"]["replicas"] = 2
        no_data["spec"]["prefill"] = {"replicas": 1}
        no_data["spec"]["routing"] = {
            "buckets": [{"maxInputTokens": 256, "mode": "colocated"}, {"mode": "disaggregated"}]
        }
        with running(operator):
            apply_pool(cluster, namespace, unreachable)
            apply_pool(cluster, namespace, no_data)
            found = wait_condition(
                cluster, namespace, "unreachable", "ScalingActive", "False", "PrometheusUnreachable"
            )
            assert (
                f"cannot reach {nowhere}" in found["message"] and "not scaling" in found["message"]
            )
            found = wait_condition(
                cluster, namespace, "nodata", "ScalingActive", "False", "NoMetrics"
            )
            assert "has no series of pool nodata" in found["message"]
            found = wait_condition(
                cluster, namespace, "nodata", "DisaggregationActive", "Unknown", "NoMetrics"
            )
            rounds = operator.total("pdserve_operator_scaling_rounds_total")
            wait_until(
                lambda: operator.total("pdserve_operator_scaling_rounds_total") >= rounds + 6, WAIT,
                "more autoscaler rounds",
            )  # fmt: skip
            assert operator.healthy()
            for pool in ("unreachable", "nodata"):
                assert replicas(cluster, namespace, f"{pool}-decode") == 2
                assert "ScaledUp" not in [r for r, _ in events(cluster, namespace, pool)]
                assert "ScaledDown" not in [r for r, _ in events(cluster, namespace, pool)]


def listed(cluster: Cluster, namespace: str, kind: str, count: int) -> list[dict[str, Any]]:
    """The objects of a kind in the namespace, once there are `count` of them."""

    def found() -> list[dict[str, Any]] | None:
        items: list[dict[str, Any]] = get_json(cluster, kind, "-n", namespace)["items"]
        return items if len(items) == count else None

    return wait_until(found, WAIT, f"{count} {kind}")


@pytest.fixture(scope="module")
def keda_crds(cluster: Cluster) -> Iterator[None]:
    """KEDA's CRDs, from its Go module (scripts/ensure-keda-crds.sh), for these tests."""
    directory = _script_output("ensure-keda-crds.sh")
    files = sorted(directory.glob("keda.sh_*.yaml"))
    for path in files:
        cluster.kubectl("apply", "--server-side", "-f", str(path))
    wait_established(cluster, "scaledobjects.keda.sh")
    wait_until(
        lambda: cluster.kubectl("get", "scaledobjects", "-A", check=False).returncode == 0,
        60, "the API server to list ScaledObjects",
    )  # fmt: skip
    yield
    for path in files:
        cluster.kubectl("delete", "-f", str(path), "--wait=true")


def test_hpa_and_keda_policies_render_objects_the_api_server_accepts(
    cluster: Cluster, kubeconfig: Path, namespace: str, keda_crds: None, tmp_path: Path
) -> None:
    operator = OperatorProcess(
        kubeconfig, tmp_path / "operator.log", [namespace],
        args=["--prometheus-url", "http://prometheus.monitoring.svc:9090"],
    )  # fmt: skip
    disaggregated = {
        "prefill": {"replicas": 1},
        "routing": {
            "buckets": [{"maxInputTokens": 256, "mode": "colocated"}, {"mode": "disaggregated"}]
        },
        "slo": {"ttft": {"seconds": 1.0, "percentile": 99.9}, "itl": {"seconds": 0.05}},
    }
    for name, scaler in (("via-hpa", "hpa"), ("via-keda", "keda")):
        manifest = pool_manifest(name, **disaggregated)
        manifest["spec"]["autoscaling"] = {
            "enabled": True,
            "prefill": {"minReplicas": 1, "maxReplicas": 4},
            "decode": {"minReplicas": 2, "maxReplicas": 6},
            "policy": {"type": scaler, "scaleDownStabilizationSeconds": 120},
        }
        apply_pool(cluster, namespace, manifest)
    with running(operator):
        hpas = listed(cluster, namespace, "hpa", 2)
        by_name = {h["metadata"]["name"]: h["spec"] for h in hpas}
        decode = by_name["via-hpa-decode"]
        assert decode["scaleTargetRef"]["name"] == "via-hpa-decode"
        assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 6)
        names = [m["external"]["metric"]["name"] for m in decode["metrics"]]
        assert names == [
            "pdserve_time_to_first_token_seconds_p99_9",
            "pdserve_inter_token_latency_seconds_p95",
            "pdserve_kv_cache_usage_ratio_per_worker",
        ]
        assert decode["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
        scaled = listed(cluster, namespace, "scaledobjects", 2)
        prefill = next(o["spec"] for o in scaled if o["metadata"]["name"] == "via-keda-prefill")
        assert prefill["scaleTargetRef"]["name"] == "via-keda-prefill"
        triggers = {t["name"]: t for t in prefill["triggers"]}
        assert set(triggers) == {"ttft-disaggregated", "prefill-queue"}
        ttft = triggers["ttft-disaggregated"]["metadata"]
        assert ttft["serverAddress"] == "http://prometheus.monitoring.svc:9090"
        assert (
            'mode="disaggregated"' in ttft["query"] and f'namespace="{namespace}"' in ttft["query"]
        )
        assert ttft["threshold"] == "1"
        # The autoscalers own the replica counts: the operator's apply leaves them out.
        for pool in ("via-hpa", "via-keda"):
            deployment = get_json(
                cluster, "deployment", f"{pool}-decode", "-n", namespace, "--show-managed-fields"
            )
            managed = [
                entry for entry in deployment["metadata"]["managedFields"]
                if entry["manager"] == "pdserve" and entry["operation"] == "Apply"
            ]  # fmt: skip
            assert managed and "f:replicas" not in json.dumps(managed[0]["fieldsV1"]["f:spec"])
