"""Rendering a ServingPool into Kubernetes objects (pure, deterministic)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli.options import options_from
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
    p = pool("disaggregated")
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
    from pdserve.workers.router.table import KubernetesDiscovery, parse_table

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


def test_only_the_pool_and_prometheus_reach_the_workers() -> None:
    policy = by_key(rendered(pool("disaggregated")))[("NetworkPolicy", "llama-pd-workers")]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    selector = spec["podSelector"]
    assert selector["matchLabels"]["app.kubernetes.io/instance"] == "llama-pd"
    assert selector["matchExpressions"][0]["values"] == ["prefill", "decode"]
    members, prometheus = spec["ingress"]
    assert members == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "pdserve",
                        "app.kubernetes.io/instance": "llama-pd",
                    }
                }
            }
        ]
    }
    assert prometheus["ports"] == [{"port": "http", "protocol": "TCP"}]


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


def test_adaptive_token_budget_reaches_the_worker_with_the_slo_as_target() -> None:
    p = with_patch(
        pool("disaggregated"),
        {"decode": {"engine": {"tokenBudget": {"mode": "adaptive", "min": 64, "max": 1024}}}},
    )
    args = render.worker_args(
        "llama-pd", p.spec, "decode", render.cluster_wiring("llama-pd", "serving", p.spec)
    )
    assert flag(args, "--token-budget") == "adaptive"
    assert flag(args, "--target-itl-ms") == "50"  # spec.slo.itl: 0.05 s
    assert (flag(args, "--min-budget"), flag(args, "--max-budget")) == ("64", "1024")
    # The prefill pool keeps its static budget; the target only counts overruns there.
    prefill = render.worker_args(
        "llama-pd", p.spec, "prefill", render.cluster_wiring("llama-pd", "serving", p.spec)
    )
    assert "--token-budget" not in prefill and flag(prefill, "--target-itl-ms") == "50"


def test_a_role_target_overrides_the_slo_and_no_target_renders_none() -> None:
    own = with_patch(
        pool("disaggregated"),
        {"decode": {"engine": {"tokenBudget": {"mode": "adaptive", "targetItlMs": 72.5}}}},
    )
    args = render.worker_args(
        "llama-pd", own.spec, "decode", render.cluster_wiring("llama-pd", "serving", own.spec)
    )
    assert flag(args, "--target-itl-ms") == "72.5" and "--max-budget" not in args
    tiny = render.worker_args(
        "tiny",
        pool("tiny-colocated").spec,
        "decode",
        render.cluster_wiring("tiny", "serving", pool("tiny-colocated").spec),
    )
    assert "--target-itl-ms" not in tiny and "--token-budget" not in tiny


def test_adaptive_worker_args_parse_with_the_worker_command() -> None:
    from pdserve.cli.options import options_from
    from pdserve.workers.server import cli as server_cli
    from pdserve.workers.server.options import WorkerOptions

    parser = argparse.ArgumentParser()
    server_cli.register(parser.add_subparsers())
    p = with_patch(
        pool("tiny-colocated"),
        {"decode": {"engine": {"tokenBudget": {"mode": "adaptive", "targetItlMs": 80}}}},
    )
    args = render.worker_args(
        "tiny", p.spec, "decode", render.cluster_wiring("tiny", "serving", p.spec)
    )
    options = options_from(parser.parse_args(args), WorkerOptions)
    assert (options.token_budget, options.target_itl_ms, options.min_budget) == ("adaptive", 80, 32)


def test_the_worker_and_the_crd_default_to_the_same_token_budget() -> None:
    from pdserve.workers.server.options import WorkerOptions

    defaults = {field.name: field.default for field in dataclasses.fields(WorkerOptions)}
    spec = api.TokenBudgetSpec()
    assert defaults["token_budget"] == spec.mode == "static"
    assert defaults["min_budget"] == spec.min_budget
    assert defaults["max_budget"] is spec.max_budget is None
