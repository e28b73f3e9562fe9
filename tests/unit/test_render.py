"""Rendering a ServingPool into Kubernetes objects (pure, deterministic).

Over 600 lines on purpose: one test module for `render`, one test per rendered object
or rule, sharing the pools they render."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.base.options import options_from
from pdserve.operator import api, render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"

Obj = dict[str, Any]
COMPONENTS = ("prefill", "decode", "router")


def pool(name: str) -> api.ServingPool:
    return api.parse_pool(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))


def rendered(p: api.ServingPool, **kwargs: Any) -> list[Obj]:
    return render.render(p.metadata.name, "serving", p.spec, **kwargs)


def by_key(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(deployment: Obj) -> Obj:
    containers: list[Obj] = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def with_patch(p: api.ServingPool, patch: Obj) -> api.ServingPool:
    """The pool with some spec fields changed (nested dict merge)."""

    def merge(base: Any, change: Any) -> Any:
        if isinstance(base, dict) and isinstance(change, dict):
            return {**base, **{k: merge(base.get(k), v) for k, v in change.items()}}
        return change

    return api.parse_pool(merge(api.dump(p), {"spec": patch}))


def test_colocated_pool_renders_no_prefill_objects() -> None:
    objects = rendered(pool("tiny-colocated"))
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "tiny-routing"),
        ("ServiceAccount", "tiny-router"),
        ("Role", "tiny-router"),
        ("RoleBinding", "tiny-router"),
        ("Service", "tiny-decode"),
        ("Service", "tiny-router"),
        ("NetworkPolicy", "tiny-workers"),
        ("Deployment", "tiny-decode"),
        ("Deployment", "tiny-router"),
        ("PodDisruptionBudget", "tiny-decode"),
        ("PodDisruptionBudget", "tiny-router"),
    ]
    assert all(o["metadata"]["namespace"] == "serving" for o in objects)


def test_colocated_decode_worker_prefills_itself() -> None:
    decode = by_key(rendered(pool("tiny-colocated")))[("Deployment", "tiny-decode")]
    worker = container(decode)
    args = worker["args"]
    assert worker["command"] == ["pdserve"]
    assert worker["image"] == "pdserve:0.1.0"
    assert args[0] == "worker"
    assert flag(args, "--role") == "both"
    assert flag(args, "--pool") == "tiny"
    assert flag(args, "--device") == "cpu"
    assert flag(args, "--model") == "/models/tiny-llama"
    assert flag(args, "--served-model-name") == "tiny-llama"
    assert flag(args, "--port") == "8000"
    assert flag(args, "--max-num-batched-tokens") == "256"
    assert flag(args, "--max-num-seqs") == "16"
    assert flag(args, "--num-kv-blocks") == "512"
    assert flag(args, "--dtype") == "float32"
    assert "--kv-transfer" not in args and "--kv-cache-memory" not in args
    assert "--kv-cache-dtype" not in args  # auto: the worker's default
    assert decode["spec"]["replicas"] == 2
    assert worker["resources"] == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"memory": "2Gi"},
    }


def test_disaggregated_workers() -> None:
    objects = by_key(rendered(pool("disaggregated")))
    prefill = container(objects[("Deployment", "llama-pd-prefill")])
    decode = container(objects[("Deployment", "llama-pd-decode")])
    assert flag(prefill["args"], "--role") == "prefill"
    assert flag(decode["args"], "--role") == "decode"
    for worker in (prefill, decode):
        assert flag(worker["args"], "--kv-transfer") == "nixl"
        assert flag(worker["args"], "--transfer-failure-policy") == "recompute"
        assert flag(worker["args"], "--block-size") == "16"
        assert flag(worker["args"], "--max-model-len") == "32768"
        assert flag(worker["args"], "--device") == "cuda"
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    assert flag(prefill["args"], "--kv-cache-memory") == str(20 * 2**30)
    assert flag(decode["args"], "--max-num-batched-tokens") == "512"
    hf = next(v for v in decode["env"] if v["name"] == "HF_TOKEN")
    assert hf["valueFrom"]["secretKeyRef"] == {
        "name": "huggingface",
        "key": "token",
        "optional": True,
    }
    pod = objects[("Deployment", "llama-pd-prefill")]["spec"]["template"]["spec"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in pod["volumes"]


def test_labels_selectors_ports_and_probes() -> None:
    objects = rendered(pool("disaggregated"))
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pdserve"
        assert labels["app.kubernetes.io/instance"] == "llama-pd"
        assert labels["pdserve.dev/pool"] == "llama-pd"
    for component in ("prefill", "decode", "router"):
        deployment = by_key(objects)[("Deployment", f"llama-pd-{component}")]
        template = deployment["spec"]["template"]
        assert template["metadata"]["labels"]["app.kubernetes.io/component"] == component
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        main = container(deployment)
        assert main["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
        assert main["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert main["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True


def test_worker_services_are_headless_and_router_service_is_not() -> None:
    objects = by_key(rendered(pool("disaggregated")))
    for role in ("prefill", "decode"):
        spec = objects[("Service", f"llama-pd-{role}")]["spec"]
        assert spec["clusterIP"] == "None"
        assert spec["selector"]["app.kubernetes.io/component"] == role
    router = objects[("Service", "llama-pd-router")]["spec"]
    assert router["type"] == "ClusterIP" and "clusterIP" not in router
    assert router["ports"][0]["targetPort"] == "http"


def test_pod_disruption_budgets_allow_one_pod_per_role() -> None:
    budgets = [o for o in rendered(pool("disaggregated")) if o["kind"] == "PodDisruptionBudget"]
    assert [b["metadata"]["name"] for b in budgets] == [
        "llama-pd-prefill",
        "llama-pd-decode",
        "llama-pd-router",
    ]
    assert all(b["spec"]["maxUnavailable"] == 1 for b in budgets)


def test_router_reads_the_routing_table() -> None:
    p = pool("disaggregated")
    objects = by_key(rendered(p))
    table = json.loads(objects[("ConfigMap", "llama-pd-routing")]["data"]["routing.json"])
    assert table["buckets"] == [
        {"maxInputTokens": 1024, "mode": "colocated"},
        {"maxInputTokens": None, "mode": "disaggregated"},
    ]
    assert table["discovery"] == {
        "kind": "kubernetes",
        "namespace": "serving",
        "port": 8000,
        "services": {"decode": "llama-pd-decode", "prefill": "llama-pd-prefill"},
    }
    assert table["kvTransfer"] == {"failurePolicy": "recompute"}
    router = objects[("Deployment", "llama-pd-router")]
    args = container(router)["args"]
    assert args[:3] == ["router", "--config", "/etc/pdserve/routing.json"]
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama-pd-router"
    assert {"name": "routing", "configMap": {"name": "llama-pd-routing"}} in pod["volumes"]
    role = objects[("Role", "llama-pd-router")]
    assert role["rules"][0]["resources"] == ["endpointslices"]


def test_decode_engine_change_touches_only_the_decode_deployment() -> None:
    p = pool("disaggregated")
    before = by_key(rendered(p))
    after = by_key(rendered(with_patch(p, {"decode": {"engine": {"maxNumBatchedTokens": 1024}}})))
    assert before.keys() == after.keys()
    changed = [key for key in before if before[key] != after[key]]
    assert changed == [("Deployment", "llama-pd-decode")]


def test_routing_change_touches_the_config_map_and_rolls_the_router() -> None:
    p = pool("disaggregated")
    before = by_key(rendered(p))
    buckets = [{"maxInputTokens": 2048, "mode": "colocated"}, {"mode": "disaggregated"}]
    after = by_key(rendered(with_patch(p, {"routing": {"buckets": buckets}})))
    changed = [key for key in before if before[key] != after[key]]
    assert changed == [("ConfigMap", "llama-pd-routing"), ("Deployment", "llama-pd-router")]
    key = ("Deployment", "llama-pd-router")
    annotation = "pdserve.dev/routing-hash"

    def digest(objects: dict[tuple[str, str], Obj]) -> str:
        value: str = objects[key]["spec"]["template"]["metadata"]["annotations"][annotation]
        return value

    assert digest(before) != digest(after)


def test_rendering_is_deterministic() -> None:
    p = pool("disaggregated")
    first = json.dumps(rendered(p))
    again = api.parse_pool(yaml.safe_load(yaml.safe_dump(api.dump(p))))
    assert json.dumps(rendered(again)) == first
    assert json.dumps(rendered(p)) == first


def test_replicas_override_and_zero_replicas() -> None:
    p = with_patch(pool("disaggregated"), {"autoscaling": {"enabled": False}})
    objects = by_key(rendered(p, replicas={"prefill": 0, "decode": 6}))
    assert ("Deployment", "llama-pd-prefill") not in objects
    assert ("Service", "llama-pd-prefill") not in objects
    assert ("PodDisruptionBudget", "llama-pd-prefill") not in objects
    assert objects[("Deployment", "llama-pd-decode")]["spec"]["replicas"] == 6
    # Scaling a role leaves the router's configuration and the decode role alone.
    unscaled = by_key(rendered(p))
    routing = ("ConfigMap", "llama-pd-routing")
    assert objects[routing] == unscaled[routing]
    decode = ("Deployment", "llama-pd-decode")
    assert container(objects[decode]) == container(unscaled[decode])


def test_router_with_zero_replicas_renders_no_router_objects() -> None:
    p = with_patch(pool("tiny-colocated"), {"router": {"replicas": 0}})
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered(p)}
    assert kinds == {
        ("Service", "tiny-decode"),
        ("NetworkPolicy", "tiny-workers"),
        ("Deployment", "tiny-decode"),
        ("PodDisruptionBudget", "tiny-decode"),
    }


def test_service_monitor_only_when_asked() -> None:
    assert all(o["kind"] != "ServiceMonitor" for o in rendered(pool("tiny-colocated")))
    monitor = rendered(pool("disaggregated"))[-1]
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": "llama-pd",
    }


def test_longest_pool_name_gives_valid_names() -> None:
    name = "p" * api.MAX_POOL_NAME
    spec = pool("disaggregated").spec
    for obj in render.render(name, "default", spec):
        assert len(obj["metadata"]["name"]) <= 63
        assert all(len(v) <= 63 for v in obj["metadata"]["labels"].values())


def test_owner_reference() -> None:
    metadata = {"name": "tiny", "namespace": "serving", "uid": "1234"}
    ref = render.owner_reference(metadata)
    assert ref == {
        "apiVersion": "pdserve.dev/v1alpha1",
        "kind": "ServingPool",
        "name": "tiny",
        "uid": "1234",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    obj = rendered(pool("tiny-colocated"))[0]
    owned = render.with_owner(obj, metadata)
    assert owned["metadata"]["ownerReferences"] == [ref]
    assert "ownerReferences" not in obj["metadata"]


def test_router_endpoint() -> None:
    assert render.router_endpoint("tiny", "serving") == "http://tiny-router.serving.svc:8000"


@pytest.mark.parametrize(
    ("quantity", "value"),
    [("4Gi", 4 * 2**30), ("1500M", 1_500_000_000), ("2e3", 2000), (512, 512), ("100m", 1)],
)
def test_kv_cache_memory_reaches_the_worker_in_bytes(quantity: int | str, value: int) -> None:
    # Kubernetes quantities become whole bytes, rounded up as Kubernetes does.
    p = pool("tiny-colocated")
    engine = p.spec.decode.engine.model_copy(
        update={"num_kv_blocks": None, "kv_cache_memory": quantity}
    )
    spec = p.spec.model_copy(update={"decode": p.spec.decode.model_copy(update={"engine": engine})})
    args = render.worker_args("tiny", spec, "decode", render.cluster_wiring("tiny", "x", spec))
    assert flag(args, "--kv-cache-memory") == str(value)
    assert "--num-kv-blocks" not in args


def parsed_command(args: list[str]) -> argparse.Namespace:
    """A rendered command line parsed by the `pdserve` command's own parsers."""
    from pdserve.workers.router import cli as router_cli
    from pdserve.workers.server import cli as server_cli

    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    server_cli.register(subparsers)
    router_cli.register(subparsers)
    return parser.parse_args(args)


def test_rendered_command_lines_parse_with_the_worker_and_router_commands() -> None:
    from pdserve.workers.router.options import RouterOptions
    from pdserve.workers.server.options import WorkerOptions

    objects = by_key(rendered(pool("disaggregated")))
    args = {c: container(objects[("Deployment", f"llama-pd-{c}")])["args"] for c in COMPONENTS}
    prefill = options_from(parsed_command(args["prefill"]), WorkerOptions)
    decode = options_from(parsed_command(args["decode"]), WorkerOptions)
    router = options_from(parsed_command(args["router"]), RouterOptions)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert prefill.pool == decode.pool == "llama-pd"
    assert prefill.max_num_batched_tokens == 8192 and decode.max_num_seqs == 256
    # KV transfer agents advertise the pod's IP (the downward API, expanded by Kubernetes).
    assert prefill.kv_transfer_host == decode.kv_transfer_host == "$(POD_IP)"
    # Decode workers take hand-offs only to the pool's prefill workers (their Service).
    assert decode.prefill_peer == ("http://llama-pd-prefill.serving.svc:8000",)
    assert prefill.prefill_peer == ()
    # Router and workers hold the same credential file, mounted from the pool's Secret.
    token = Path("/var/run/secrets/pdserve/token")
    assert prefill.internal_token_file == decode.internal_token_file == token
    assert router.internal_token_file == token
    assert router.config == Path("/etc/pdserve/routing.json") and router.port == 8000
    pod = objects[("Deployment", "llama-pd-router")]["spec"]["template"]["spec"]
    assert {
        "name": "credential",
        "secret": {"secretName": "llama-pd-internal", "defaultMode": 0o440},
    } in pod["volumes"]
    env = {v["name"]: v for v in container(objects[("Deployment", "llama-pd-decode")])["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_colocated_worker_args_parse_with_the_worker_command() -> None:
    p = pool("tiny-colocated")
    wiring = render.cluster_wiring("tiny", "serving", p.spec)
    parsed = parsed_command(render.worker_args("tiny", p.spec, "decode", wiring))
    assert parsed.role == "both" and parsed.pool == "tiny"
    assert parsed.max_num_batched_tokens == 256 and parsed.num_kv_blocks == 512
    assert parsed.prefill_peer == [] and parsed.kv_transfer_host is None


def test_the_rendered_routing_table_is_one_the_router_reads() -> None:
    from pdserve.protocol.routing import KubernetesDiscovery, parse_table

    for name in ("disaggregated", "tiny-colocated", "tiny-disaggregated"):
        p = pool(name)
        data = render.routing_json(render.routing_table(p.metadata.name, "serving", p.spec))
        table = parse_table(data.encode())
        assert [b.mode for b in table.buckets] == [b.mode for b in p.spec.routing.buckets]
        assert isinstance(table.discovery, KubernetesDiscovery)
    table = parse_table(
        render.routing_json(
            render.routing_table("llama-pd", "serving", pool("disaggregated").spec)
        ).encode()
    )
    assert (table.slo.ttft_seconds, table.slo.itl_seconds) == (2.0, 0.05)
    assert table.bucket_label(table.bucket_of(1024)) == "le1024"
    assert table.bucket_label(table.bucket_of(1025)) == "gt1024"


def test_the_routing_policy_reaches_the_router_with_the_workers_block_size_and_seed() -> None:
    from pdserve.protocol.routing import parse_table

    p = pool("disaggregated")
    default = parse_table(render.routing_json(render.routing_table("a", "s", p.spec)).encode())
    assert default.routing_policy.type == "kv-aware"
    assert default.routing_policy.block_size == p.spec.kv_cache.block_size
    changed = p.spec.model_copy(
        update={
            "routing": p.spec.routing.model_copy(update={"policy": "load"}),
            "kv_cache": p.spec.kv_cache.model_copy(
                update={"block_size": 32, "hash_seed": "pool-a"}
            ),
        }
    )
    table = parse_table(render.routing_json(render.routing_table("a", "s", changed)).encode())
    assert (table.routing_policy.type, table.routing_policy.block_size) == ("load", 32)
    assert table.routing_policy.hash_seed == "pool-a"
    args = parsed_command(
        render.worker_args("a", changed, "decode", render.cluster_wiring("a", "s", changed))
    )
    assert args.block_size == table.routing_policy.block_size
    assert args.prefix_caching_hash_seed == table.routing_policy.hash_seed
    assert default.routing_policy.hash_seed == ""


MEMBERS = {
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/name": "pdserve",
            "app.kubernetes.io/instance": "llama-pd",
        }
    }
}
HTTP = [{"port": "http", "protocol": "TCP"}]


def test_only_the_pool_and_its_monitoring_namespace_reach_the_workers() -> None:
    policy = by_key(rendered(pool("disaggregated")))[("NetworkPolicy", "llama-pd-workers")]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    selector = spec["podSelector"]
    assert selector["matchLabels"]["app.kubernetes.io/instance"] == "llama-pd"
    assert selector["matchExpressions"][0]["values"] == ["prefill", "decode"]
    # No monitoring namespace named: the pool's own pods only.
    assert spec["ingress"] == [{"from": [MEMBERS]}]
    # Out: the pool's pods, and DNS.
    dns = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert spec["egress"] == [{"to": [MEMBERS]}, {"ports": dns}]
    # The operator's --prometheus-namespace, or the pool's own: by the namespace's name,
    # never by a label any pod may carry.
    by_default = rendered(pool("disaggregated"), prometheus_namespace="monitoring")
    named = with_patch(pool("disaggregated"), {"monitoring": {"prometheusNamespace": "obs"}})
    for objects, namespace in ((by_default, "monitoring"), (rendered(named), "obs")):
        ingress = by_key(objects)[("NetworkPolicy", "llama-pd-workers")]["spec"]["ingress"]
        by_name = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
        assert ingress == [
            {"from": [MEMBERS]},
            {"from": [{"namespaceSelector": by_name}], "ports": HTTP},
        ]
    overridden = rendered(named, prometheus_namespace="monitoring")
    assert (
        by_key(overridden)[("NetworkPolicy", "llama-pd-workers")]
        == by_key(rendered(named))[("NetworkPolicy", "llama-pd-workers")]
    )


def test_direct_clients_are_a_pools_choice() -> None:
    p = pool("disaggregated")
    objects = by_key(rendered(p))
    for role in ("prefill", "decode"):
        args = container(objects[("Deployment", f"llama-pd-{role}")])["args"]
        assert "--allow-direct-clients" not in args
    opened = by_key(rendered(with_patch(p, {"router": {"allowDirectClients": True}})))
    for role in ("prefill", "decode"):
        assert (
            "--allow-direct-clients"
            in container(opened[("Deployment", f"llama-pd-{role}")])["args"]
        )
    # The pool's namespace may then reach the workers' http port (no other namespace).
    ingress = opened[("NetworkPolicy", "llama-pd-workers")]["spec"]["ingress"]
    assert ingress == [{"from": [MEMBERS]}, {"from": [{"podSelector": {}}], "ports": HTTP}]


def test_containers_run_with_a_read_only_root_filesystem() -> None:
    objects = by_key(rendered(pool("disaggregated")))
    for component in COMPONENTS:
        deployment = objects[("Deployment", f"llama-pd-{component}")]
        main = container(deployment)
        assert main["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        }
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        # What the processes write goes to emptyDirs: temporary files, and caches
        # under $HOME (torch's, Triton's).
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for path in ("/tmp", "/home/pdserve"):
            assert volumes[mounts[path]]["emptyDir"] == {}, (component, path)
        assert {"name": "HOME", "value": "/home/pdserve"} in main["env"]
        if component != "router":
            assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    # A pool's own HOME wins.
    p = with_patch(pool("tiny-colocated"), {"decode": {"env": [{"name": "HOME", "value": "/x"}]}})
    env = container(by_key(rendered(p))[("Deployment", "tiny-decode")])["env"]
    assert [v for v in env if v["name"] == "HOME"] == [{"name": "HOME", "value": "/x"}]


def test_client_api_keys_come_from_a_secret() -> None:
    p = with_patch(pool("tiny-colocated"), {"router": {"apiKeys": {"name": "keys", "key": "list"}}})
    router = by_key(rendered(p))[("Deployment", "tiny-router")]
    args = container(router)["args"]
    assert flag(args, "--api-key-file") == "/var/run/secrets/pdserve-api-keys/keys"
    volumes = router["spec"]["template"]["spec"]["volumes"]
    keys = next(v for v in volumes if v["name"] == "api-keys")
    assert keys["secret"]["secretName"] == "keys"
    assert keys["secret"]["items"] == [{"key": "list", "path": "keys"}]
    assert (
        "--api-key-file"
        not in container(by_key(rendered(pool("tiny-colocated")))[("Deployment", "tiny-router")])[
            "args"
        ]
    )


def test_the_worker_and_the_crd_default_to_the_same_hand_off() -> None:
    from pdserve.workers.server.options import WorkerOptions

    defaults = {field.name: field.default for field in dataclasses.fields(WorkerOptions)}
    spec = api.KvTransferSpec()
    assert defaults["kv_transfer"] == spec.backend == "nixl"
    assert defaults["transfer_failure_policy"] == spec.failure_policy


# --- autoscaling, draining, scraping ---------------------------------------------------


def autoscaled(scaler: str = "planner", **policy: Any) -> api.ServingPool:
    return with_patch(
        pool("disaggregated"), {"autoscaling": {"policy": {"type": scaler, **policy}}}
    )


def test_planner_counts_stay_within_the_bounds_and_a_role_scaled_to_zero_keeps_its_deployment() -> (
    None
):
    p = with_patch(autoscaled(), {"autoscaling": {"prefill": {"minReplicas": 0}}})
    objects = by_key(rendered(p, replicas={"prefill": 0, "decode": 20}))
    assert objects[("Deployment", "llama-pd-prefill")]["spec"]["replicas"] == 0
    assert objects[("Deployment", "llama-pd-decode")]["spec"]["replicas"] == 8  # maxReplicas
    # Without a decision the spec's count, brought within the bounds.
    low = with_patch(autoscaled(), {"decode": {"replicas": 1}})
    assert by_key(rendered(low))[("Deployment", "llama-pd-decode")]["spec"]["replicas"] == 2


@pytest.mark.parametrize("scaler", ["hpa", "keda"])
def test_hpa_and_keda_own_the_worker_counts(scaler: str) -> None:
    objects = by_key(rendered(autoscaled(scaler), prometheus_url="http://prom:9090"))
    for role in ("prefill", "decode"):
        assert "replicas" not in objects[("Deployment", f"llama-pd-{role}")]["spec"]
    assert objects[("Deployment", "llama-pd-router")]["spec"]["replicas"] == 1
    kind = "HorizontalPodAutoscaler" if scaler == "hpa" else "ScaledObject"
    scaler_spec = objects[(kind, "llama-pd-prefill")]["spec"]
    assert scaler_spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-pd-prefill"
    }  # fmt: skip


def test_hpa_reads_external_metrics_against_the_slo() -> None:
    hpa = by_key(rendered(autoscaled("hpa", maxScaleUpStep=3, cooldownSeconds=90)))
    decode = hpa[("HorizontalPodAutoscaler", "llama-pd-decode")]["spec"]
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 8)
    metrics = {m["external"]["metric"]["name"]: m["external"] for m in decode["metrics"]}
    ttft = metrics["pdserve_time_to_first_token_seconds_p95"]
    assert ttft["metric"]["selector"]["matchLabels"] == {
        "pool": "llama-pd", "namespace": "serving", "mode": "colocated"
    }  # fmt: skip
    assert ttft["target"] == {"type": "Value", "value": "2000m"}
    assert metrics["pdserve_inter_token_latency_seconds_p95"]["target"]["value"] == "50m"
    assert metrics["pdserve_kv_cache_usage_ratio_per_worker"]["target"]["value"] == "850m"
    up = decode["behavior"]["scaleUp"]
    assert up["policies"] == [{"type": "Pods", "value": 3, "periodSeconds": 90}]
    assert decode["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_keda_triggers_carry_the_planners_queries() -> None:
    objects = by_key(rendered(autoscaled("keda", windowSeconds=30), prometheus_url="http://p:9090"))
    decode = objects[("ScaledObject", "llama-pd-decode")]["spec"]
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (2, 8)
    triggers = {t["name"]: t for t in decode["triggers"]}
    assert set(triggers) == {"ttft-colocated", "itl", "kv-cache-usage"}
    itl = triggers["itl"]
    assert itl["metricType"] == "Value"
    assert itl["metadata"]["serverAddress"] == "http://p:9090"
    assert itl["metadata"]["threshold"] == "0.05"
    assert "histogram_quantile(0.95" in itl["metadata"]["query"]
    assert '{pool="llama-pd",namespace="serving",role="router"}[30s]' in itl["metadata"]["query"]
    # The pool's own Prometheus wins; without any, no ScaledObject can be made.
    own = with_patch(
        autoscaled("keda"), {"autoscaling": {"policy": {"prometheusUrl": "http://mine"}}}
    )
    found = by_key(rendered(own, prometheus_url="http://p:9090"))[
        ("ScaledObject", "llama-pd-decode")
    ]
    assert found["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://mine"
    assert not [o for o in rendered(autoscaled("keda")) if o["kind"] == "ScaledObject"]


def test_workers_drain_within_a_grace_period_sized_from_the_spec() -> None:
    p = with_patch(pool("disaggregated"), {"decode": {"drainSeconds": 100}})
    objects = by_key(rendered(p))
    decode = objects[("Deployment", "llama-pd-decode")]
    pod_spec = decode["spec"]["template"]["spec"]
    assert pod_spec["terminationGracePeriodSeconds"] == render.PRE_STOP_SECONDS + 100 + 5
    assert container(decode)["lifecycle"] == {
        "preStop": {"sleep": {"seconds": render.PRE_STOP_SECONDS}}
    }
    assert flag(container(decode)["args"], "--drain-timeout") == "100"
    prefill = objects[("Deployment", "llama-pd-prefill")]
    assert flag(container(prefill)["args"], "--drain-timeout") == "60"  # the default


def test_pods_carry_scrape_annotations_unless_turned_off() -> None:
    objects = by_key(rendered(pool("disaggregated")))
    for component in ("prefill", "decode", "router"):
        template = objects[("Deployment", f"llama-pd-{component}")]["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(render.PORT)
    off = with_patch(pool("disaggregated"), {"monitoring": {"scrapeAnnotations": False}})
    template = by_key(rendered(off))[("Deployment", "llama-pd-decode")]["spec"]["template"]
    assert "prometheus.io/scrape" not in template["metadata"]["annotations"]


def cluster_args(name: str, spec: api.ServingPoolSpec, role: api.Role) -> list[str]:
    """A role's worker command line as the cluster runs it."""
    return render.worker_args(name, spec, role, render.cluster_wiring(name, "default", spec))


def test_adaptive_token_budget_reaches_the_worker_with_the_slo_as_target() -> None:
    p = with_patch(
        pool("disaggregated"),
        {"decode": {"engine": {"tokenBudget": {"mode": "adaptive", "min": 64, "max": 1024}}}},
    )
    args = cluster_args("llama-pd", p.spec, "decode")
    assert flag(args, "--token-budget") == "adaptive"
    assert flag(args, "--target-itl-ms") == "50"  # spec.slo.itl: 0.05 s
    assert (flag(args, "--min-budget"), flag(args, "--max-budget")) == ("64", "1024")
    # The prefill pool keeps its static budget; the target only counts overruns there.
    prefill = cluster_args("llama-pd", p.spec, "prefill")
    assert "--token-budget" not in prefill and flag(prefill, "--target-itl-ms") == "50"


def test_a_role_target_overrides_the_slo_and_no_target_renders_none() -> None:
    own = with_patch(
        pool("disaggregated"),
        {"decode": {"engine": {"tokenBudget": {"mode": "adaptive", "targetItlMs": 72.5}}}},
    )
    args = cluster_args("llama-pd", own.spec, "decode")
    assert flag(args, "--target-itl-ms") == "72.5" and "--max-budget" not in args
    tiny = cluster_args("tiny", pool("tiny-colocated").spec, "decode")
    assert "--target-itl-ms" not in tiny and "--token-budget" not in tiny


def test_adaptive_worker_args_parse_with_the_worker_command() -> None:
    from pdserve.base.options import options_from
    from pdserve.workers.server import cli as server_cli
    from pdserve.workers.server.options import WorkerOptions

    parser = argparse.ArgumentParser()
    server_cli.register(parser.add_subparsers())
    p = with_patch(
        pool("tiny-colocated"),
        {"decode": {"engine": {"tokenBudget": {"mode": "adaptive", "targetItlMs": 80}}}},
    )
    args = cluster_args("tiny", p.spec, "decode")
    options = options_from(parser.parse_args(args), WorkerOptions)
    assert (options.token_budget, options.target_itl_ms, options.min_budget) == ("adaptive", 80, 32)


def test_the_worker_and_the_crd_default_to_the_same_token_budget() -> None:
    from pdserve.workers.server.options import WorkerOptions

    defaults = {field.name: field.default for field in dataclasses.fields(WorkerOptions)}
    spec = api.TokenBudgetSpec()
    assert defaults["token_budget"] == spec.mode == "static"
    assert defaults["min_budget"] == spec.min_budget
    assert defaults["max_budget"] is spec.max_budget is None
