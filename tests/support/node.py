"""A pool on the real node, for tests: the chart installed from the images `make
images` builds, the model on a volume, a small disaggregated pool pinned to the node,
and what its pods and the router's Service say."""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.devcluster.node import NodeCluster
from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint
from render_deploy import CHART, run_helm, value_flags
from support.router import BOUNDARY
from support.waiting import wait_until

__all__ = ["wait_until"]

# Pods take a while on a loaded machine: torch loads from the image, then the model.
POD_WAIT = 420.0
MODEL_MOUNT = "/models"
MODEL_NAME = "small"
CLAIM = "models"
MONITORING = "monitoring"  # the namespace the pools' NetworkPolicies admit to /metrics
# The tests' small model (tests/conftest.py), written where the pods' user can read it.
NODE_MODEL = TinyModelSpec(
    layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024, max_position=2048
)
# A prompt the router serves colocated, and one it hands over (longer than BOUNDARY).
SHORT_PROMPT = list(range(5, 5 + 16))
LONG_PROMPT = [(7 * i) % 1000 + 3 for i in range(BOUNDARY * 3)]
_variants = itertools.count(1)


def fresh_long_prompt() -> list[int]:
    """A prompt as long as LONG_PROMPT that shares no KV block with any prompt sent
    before: a decode worker holding a prompt's prefix serves it colocated (KV-aware
    routing decides on uncached tokens), so a test that must see a hand-off sends one."""
    shift = next(_variants)
    return [(token + shift) % 1000 + 3 for token in LONG_PROMPT]


def helm_on(cluster: NodeCluster, *args: str) -> str:
    """Helm against the node's cluster; its stdout."""
    return run_helm(*args, "--kubeconfig", str(cluster.kubeconfig)).stdout


def install_chart(
    cluster: NodeCluster, release_ns: str, pools_ns: str, operator_image: str
) -> None:
    """`helm install` of the chart, its operator pod on the node, watching `pools_ns`."""
    repository, tag = operator_image.rsplit(":", 1)
    values: dict[str, Any] = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "watchNamespaces": [pools_ns],
        "prometheusNamespace": MONITORING,
        "nodeSelector": {"kubernetes.io/hostname": cluster.node_name},
    }
    helm_on(
        cluster, "install", "pdserve", str(CHART), "--namespace", release_ns,
        "--wait", "--timeout", f"{int(POD_WAIT)}s", *value_flags(values),
    )  # fmt: skip


@contextmanager
def model_on_volume(spec: TinyModelSpec) -> Iterator[Path]:
    """A tiny checkpoint in a folder the pods' user can read (hostPath of a PV)."""
    folder = Path(tempfile.mkdtemp(prefix="pdserve-node-model-"))
    try:
        model = folder / MODEL_NAME
        write_tiny_checkpoint(model, spec)
        for path in (folder, *folder.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def model_claim(cluster: NodeCluster, namespace: str, folder: Path) -> None:
    """A hostPath PersistentVolume holding `folder`, bound to the claim the pool names."""
    volume_name = f"models-{namespace}"
    objects = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": str(folder), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": CLAIM},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume_name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )


def node_pool(name: str, image: str, node: str, **spec: Any) -> dict[str, Any]:
    """A small disaggregated pool on the node: prompts over BOUNDARY tokens are
    prefilled by the prefill pod and their KV cache handed to the decode pod."""
    engine = {"maxNumBatchedTokens": 64, "maxNumSeqs": 16, "numKvBlocks": 256}
    pinned = {"nodeSelector": {"kubernetes.io/hostname": node}}
    base: dict[str, Any] = {
        "model": {
            "name": MODEL_NAME, "path": f"{MODEL_MOUNT}/{MODEL_NAME}", "dtype": "float32",
            "maxModelLen": 1024, "claimName": CLAIM, "mountPath": MODEL_MOUNT,
        },
        "image": image,
        "imagePullPolicy": "Never",
        "prefill": {"replicas": 1, "engine": engine, **pinned},
        "decode": {"replicas": 1, "engine": engine, "drainSeconds": 30, **pinned},
        "router": pinned,
        "kvTransfer": {"backend": "nixl", "failurePolicy": "recompute"},
        "routing": {"buckets": [
            {"maxInputTokens": BOUNDARY, "mode": "colocated"}, {"mode": "disaggregated"},
        ]},
        "slo": {"ttft": {"seconds": 5.0}, "itl": {"seconds": 1.0}},
    }  # fmt: skip
    base.update(spec)
    return {
        "apiVersion": "pdserve.dev/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": name},
        "spec": base,
    }


def pods(cluster: NodeCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods matching a label selector."""
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod is Running, Ready, and not being deleted."""
    if pod["metadata"].get("deletionTimestamp") or pod.get("status", {}).get("phase") != "Running":
        return False
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
    )


def component(pool: str, name: str) -> str:
    """The label selector of a pool's component's pods."""
    return f"app.kubernetes.io/instance={pool},app.kubernetes.io/component={name}"


def wait_pods_ready(
    cluster: NodeCluster, namespace: str, selector: str, count: int, timeout: float = POD_WAIT
) -> list[dict[str, Any]]:
    """Exactly `count` pods of `selector` Ready (the others gone)."""

    def settled() -> list[dict[str, Any]] | None:
        found = pods(cluster, namespace, selector)
        ok = [p for p in found if ready(p)]
        return ok if len(ok) == count and len(found) == count else None

    return wait_until(
        settled, timeout, f"{count} pod(s) {selector} Ready in {namespace}", interval=1.0
    )


def service_url(cluster: NodeCluster, namespace: str, name: str, port: int = 8000) -> str:
    """http://CLUSTER-IP:PORT of a Service (routed from this machine to the node)."""
    out = cluster.kubectl(
        "get", "service", name, "-n", namespace, "-o", "jsonpath={.spec.clusterIP}"
    )
    return f"http://{out.stdout.strip()}:{port}"


def complete(
    url: str, prompt: list[int], max_tokens: int, timeout: float = 120.0
) -> tuple[dict[str, Any], dict[str, str]]:
    """A greedy completion: the answer and its headers."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read()), dict(response.headers)


def wait_serving(url: str, timeout: float = 120.0) -> float:
    """Seconds until the router at `url` first answers a completion."""
    began = time.monotonic()

    def served() -> bool:
        try:
            complete(url, SHORT_PROMPT, 2, timeout=30.0)
        except OSError:
            return False
        return True

    wait_until(served, timeout, f"a completion from {url}", interval=1.0)
    return time.monotonic() - began


def pod_url(pod: Mapping[str, Any], port: int = 8000) -> str:
    """http://POD-IP:PORT (routed from this machine to the node)."""
    return f"http://{pod['status']['podIP']}:{port}"


def pod_total(cluster: NodeCluster, pod: Mapping[str, Any], name: str) -> float:
    """The sum of a metric's samples, scraped inside the pod (on its loopback: the
    pool's NetworkPolicy admits no client from this machine)."""
    scrape = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/metrics').read().decode())"
    meta = pod["metadata"]
    text = cluster.kubectl(
        "exec", "-n", meta["namespace"], meta["name"], "--", "python3", "-c", scrape
    ).stdout
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def started_to_ready(pod: Mapping[str, Any]) -> dict[str, float]:
    """Seconds from the pod's start to its container's start and to Ready (image pull
    excluded: images are in the node's store)."""

    def stamp(text: str) -> float:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))

    status = pod["status"]
    started = stamp(status["startTime"])
    (container,) = status["containerStatuses"]
    running = stamp(container["state"]["running"]["startedAt"])
    ready_at = next(
        stamp(c["lastTransitionTime"]) for c in status["conditions"] if c["type"] == "Ready"
    )
    return {"container_started": running - started, "ready": ready_at - started}


def reaches(cluster: NodeCluster, namespace: str, image: str, url: str) -> bool:
    """Whether a pod in `namespace` gets any HTTP answer from `url` (within 5 s)."""
    probe = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        f"    urllib.request.urlopen({url!r}, timeout=5)\n"
        "except urllib.error.HTTPError:\n"
        "    pass\n"
        "except OSError:\n"
        "    sys.exit(3)\n"
    )
    overrides = {"spec": {"nodeSelector": {"kubernetes.io/hostname": cluster.node_name}}}
    result = cluster.kubectl(
        "run", f"probe-{int(time.monotonic() * 1000) % 100000}", "-n", namespace, "--rm", "-i",
        "--restart=Never", f"--image={image}", "--image-pull-policy=Never",
        f"--overrides={json.dumps(overrides)}", "--command", "--", "python3", "-c", probe,
        check=False,
    )  # fmt: skip
    return result.returncode == 0
