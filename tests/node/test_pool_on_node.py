"""`helm install`, then a small disaggregated pool on the real node: the rendered pods
start and turn Ready under their probes, serve through the router's Service (kube-proxy),
hand KV over between pods, answer as a local worker does, survive a deleted prefill pod
and drain a decode pod on scale-down without a failed request, and run with the
rendered securityContext."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.devcluster.node import NodeCluster
from pdserve.operator import api
from support import node
from support.load import load
from support.pool_cluster import make_namespace, patch_pool
from support.prom import total
from support.results import publish
from support.router import local_pool
from support.worker import running_worker

POOL = "tiny"
TRANSFERRED = "pdserve_kv_transfer_bytes_total"
DURATION = "pdserve_kv_transfer_duration_seconds"


@dataclass
class ServedPool:
    """The installed chart and pool, and what it took to get there."""

    cluster: NodeCluster
    namespace: str
    url: str
    model_dir: Path
    apply_to_first_completion: float


@pytest.fixture(scope="module")
def served(node_cluster: NodeCluster, node_images: dict[str, str]) -> Iterator[ServedPool]:
    cluster = node_cluster
    release_ns = make_namespace(cluster.control_plane, "pdserve")
    namespace = make_namespace(cluster.control_plane, "pools")
    node.install_chart(cluster, release_ns, namespace, node_images["operator"])
    with node.model_on_volume(node.NODE_MODEL) as folder:
        node.model_claim(cluster, namespace, folder)
        manifest = node.node_pool(POOL, node_images["worker"], cluster.node_name)
        began = time.monotonic()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))
        router = node.wait_pods_ready(cluster, namespace, node.component(POOL, "router"), 1)
        assert router
        url = node.service_url(cluster, namespace, f"{POOL}-router")
        node.wait_serving(url)
        seconds = time.monotonic() - began
        print(f"kubectl apply to first completion through the Service: {seconds:.1f}s")
        yield ServedPool(cluster, namespace, url, folder / node.MODEL_NAME, seconds)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        node.helm_on(cluster, "uninstall", "pdserve", "--namespace", release_ns)


def test_every_pod_turns_ready_under_the_rendered_probes(served: ServedPool) -> None:
    for role in ("router", "prefill", "decode"):
        (pod,) = node.wait_pods_ready(
            served.cluster, served.namespace, node.component(POOL, role), 1
        )
        (container,) = pod["spec"]["containers"]
        assert {"startupProbe", "livenessProbe", "readinessProbe"} <= container.keys()
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and status["restartCount"] == 0, status
        print(f"{role}: start to Ready {node.started_to_ready(pod)}")


def test_short_and_long_prompts_through_the_service_match_a_local_worker(
    served: ServedPool, tmp_path: Path
) -> None:
    (decode,) = node.pods(served.cluster, served.namespace, node.component(POOL, "decode"))
    moved_before = node.pod_total(served.cluster, decode, TRANSFERRED)
    short, short_headers = node.complete(served.url, node.SHORT_PROMPT, 16)
    long, long_headers = node.complete(served.url, node.LONG_PROMPT, 16)
    assert short_headers["X-Pdserve-Mode"] == "colocated"
    assert long_headers["X-Pdserve-Mode"] == "disaggregated"
    # The long prompt's KV cache moved from the prefill pod to the decode pod.
    assert node.pod_total(served.cluster, decode, TRANSFERRED) > moved_before
    with running_worker(
        served.model_dir, tmp_path, "--served-model-name", node.MODEL_NAME
    ) as local:
        for prompt, answer in ((node.SHORT_PROMPT, short), (node.LONG_PROMPT, long)):
            expected, _ = node.complete(local.url, prompt, 16)
            assert answer["choices"][0]["text"] == expected["choices"][0]["text"]


def test_the_containers_run_as_rendered_read_only_and_unprivileged(served: ServedPool) -> None:
    for role in ("router", "decode"):
        (pod,) = node.pods(served.cluster, served.namespace, node.component(POOL, role))
        name = pod["metadata"]["name"]
        exec_ = ["exec", "-n", served.namespace, name, "--", "python3", "-c"]
        identity = served.cluster.kubectl(*exec_, "import os; print(os.getuid(), os.getgid())")
        assert identity.stdout.split() == ["1000", "1000"]
        write = served.cluster.kubectl(*exec_, "open('/opt/x', 'w')", check=False)
        assert write.returncode != 0 and "Read-only file system" in write.stderr
        caps = served.cluster.kubectl(*exec_, "print(open('/proc/self/status').read())")
        effective = next(line for line in caps.stdout.splitlines() if line.startswith("CapEff"))
        assert int(effective.split()[1], 16) == 0


def test_a_prefill_pod_deleted_under_load_fails_no_request(served: ServedPool) -> None:
    cluster, namespace = served.cluster, served.namespace
    selector = node.component(POOL, "prefill")
    (old,) = node.pods(cluster, namespace, selector)
    with load(
        served.url, node.MODEL_NAME, clients=3, prompt=node.LONG_PROMPT, max_tokens=24
    ) as running:
        time.sleep(3)
        cluster.kubectl("delete", "pod", "-n", namespace, old["metadata"]["name"], "--wait=false")
        (new,) = node.wait_pods_ready(cluster, namespace, selector, 1)
        assert new["metadata"]["name"] != old["metadata"]["name"]
        (decode,) = node.pods(cluster, namespace, node.component(POOL, "decode"))
        moved = node.pod_total(cluster, decode, TRANSFERRED)

        def handed_over_again() -> bool:
            _, headers = node.complete(served.url, node.fresh_long_prompt(), 4)
            now = node.pod_total(cluster, decode, TRANSFERRED)
            return headers["X-Pdserve-Mode"] == "disaggregated" and now > moved

        node.wait_until(
            handed_over_again, 120.0, "disaggregation through the new prefill pod", interval=2.0
        )
    outcomes = running.outcomes
    print(f"prefill pod deleted under load: {outcomes.ok} ok, {outcomes.failed} failed")
    assert outcomes.ok > 0 and outcomes.failed == 0, outcomes.errors[:5]


def test_a_decode_pod_scaled_down_under_load_drains_its_streams(served: ServedPool) -> None:
    cluster, namespace = served.cluster, served.namespace
    selector = node.component(POOL, "decode")
    patch_pool(cluster.control_plane, namespace, POOL, {"decode": {"replicas": 2}})
    node.wait_pods_ready(cluster, namespace, selector, 2)
    with load(
        served.url, node.MODEL_NAME, clients=4, prompt=node.SHORT_PROMPT, max_tokens=48
    ) as running:
        time.sleep(3)
        began = time.monotonic()
        patch_pool(cluster.control_plane, namespace, POOL, {"decode": {"replicas": 1}})
        node.wait_pods_ready(cluster, namespace, selector, 1)
        gone_after = time.monotonic() - began
        time.sleep(2)
    outcomes = running.outcomes
    print(f"decode scale-down under load: {outcomes.ok} ok, {outcomes.failed} failed, ")
    print(f"the drained pod gone after {gone_after:.1f}s")
    assert outcomes.ok > 0 and outcomes.failed == 0, outcomes.errors[:5]
    # Drained within the rendered grace period (60 s), not killed at its end.
    assert gone_after < 60


def test_the_network_policy_admits_the_pool_and_monitoring_only(served: ServedPool) -> None:
    cluster, namespace = served.cluster, served.namespace
    enforcer = cluster.network_policies
    if enforcer is None:
        pytest.skip("no NetworkPolicy implementation")
    if enforcer.unsupported:
        pytest.skip(enforcer.unsupported)
    (decode,) = node.pods(cluster, namespace, node.component(POOL, "decode"))
    worker = node.pod_url(decode)
    outsider_ns = make_namespace(cluster.control_plane, "outsider")
    cluster.kubectl("create", "namespace", node.MONITORING, check=False)
    monitoring_ns = node.MONITORING
    try:
        image = decode["spec"]["containers"][0]["image"]
        for path in ("/metrics", "/pd/connect", "/v1/models"):
            assert not node.reaches(cluster, outsider_ns, image, f"{worker}{path}"), path
        assert node.reaches(cluster, monitoring_ns, image, f"{worker}/metrics")
        _, headers = node.complete(served.url, node.fresh_long_prompt(), 4)
        assert headers["X-Pdserve-Mode"] == "disaggregated"
    finally:
        cluster.kubectl("delete", "namespace", outsider_ns, "--wait=false")


Totals = Callable[[str], float]


def handoff_totals(read: Sequence[Totals]) -> tuple[float, float, float]:
    """(bytes, seconds, transfers) of the KV hand-offs the workers counted."""
    names = (TRANSFERRED, f"{DURATION}_sum", f"{DURATION}_count")
    moved, seconds, count = (sum(worker(name) for worker in read) for name in names)
    return moved, seconds, count


def handoff_rate(router: str, workers: Sequence[Totals], prompts: int) -> dict[str, float]:
    """Send `prompts` disaggregated prompts one at a time; the hand-offs' bandwidth."""
    before = handoff_totals(workers)
    for _ in range(prompts):
        _, headers = node.complete(router, node.fresh_long_prompt(), 2)
        assert headers["X-Pdserve-Mode"] == "disaggregated"
    moved, seconds, count = (a - b for a, b in zip(handoff_totals(workers), before, strict=True))
    assert count > 0 and seconds > 0, "no hand-off was counted"
    return {"bytes_per_transfer": moved / count, "ms_per_transfer": 1e3 * seconds / count,
            "mb_per_s": moved / seconds / 1e6}  # fmt: skip


@pytest.mark.slow
def test_measure_handoff_pod_to_pod_against_process_to_process(
    served: ServedPool, tmp_path: Path
) -> None:
    prompts = 20
    pods = [
        functools.partial(node.pod_total, served.cluster, pod)
        for role in ("prefill", "decode")
        for pod in node.pods(served.cluster, served.namespace, node.component(POOL, role))
    ]
    on_node = handoff_rate(served.url, pods, prompts)
    manifest = node.node_pool(POOL, "unused", served.cluster.node_name)
    manifest["spec"]["model"].update(path=str(served.model_dir), claimName=None)
    for role in ("prefill", "decode", "router"):
        manifest["spec"][role].pop("nodeSelector")
    with local_pool(api.parse_pool(manifest), tmp_path / "local") as local:
        workers = [
            functools.partial(total, f"{p.url}/metrics")
            for p in local.processes
            if p.url != local.url
        ]
        local_rate = handoff_rate(local.url, workers, prompts)
    rows = [{"path": "pod to pod (node)", **on_node}, {"path": "process to process", **local_rate}]
    ratio = on_node["mb_per_s"] / local_rate["mb_per_s"]
    publish(
        "node_kv_handoff", rows, extra={"prompts": prompts, "pod_over_process": round(ratio, 3)}
    )


@pytest.mark.slow
def test_measure_pod_start_to_ready(served: ServedPool) -> None:
    rows = []
    for role in ("router", "prefill", "decode"):
        (pod,) = node.pods(served.cluster, served.namespace, node.component(POOL, role))
        rows.append({"role": role, **node.started_to_ready(pod)})
    publish(
        "node_pod_start",
        rows,
        extra={"apply_to_first_completion_s": round(served.apply_to_first_completion, 1)},
    )
