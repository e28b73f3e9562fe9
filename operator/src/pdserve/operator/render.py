"""Pure rendering: a ServingPool spec -> the Kubernetes objects it stands for.

Over 600 lines on purpose: the objects of one pool, in apply order, share their names,
labels, wiring and pod template helpers; the scalers (HPA/KEDA) are apart already.

Nothing here does I/O; the handlers apply the result (server-side apply) and the
local backend reuses the command lines. Every object is a plain dict, built in a
fixed order, so the same spec always renders the same bytes.

Objects, in apply order (a role with 0 replicas, or without a pool, has none):
  ConfigMap       <pool>-routing    routing.json, read by the router
  ServiceAccount  <pool>-router     + Role/RoleBinding to watch EndpointSlices
  Service         <pool>-prefill    headless: worker discovery
  Service         <pool>-decode     headless: worker discovery
  Service         <pool>-router     the pool's front door
  NetworkPolicy   <pool>-workers    only the pool's pods (and a named monitoring
                                    namespace, on the http port) reach the workers;
                                    the workers reach only the pool's pods and DNS
  Deployment      <pool>-prefill, <pool>-decode, <pool>-router; a role whose
                  rollout strategy is canary has one Deployment per revision
                  instead, <pool>-<revision> (see "Revisions" below)
  PodDisruptionBudget (maxUnavailable 1) per Deployment
  ServiceMonitor  <pool>            when spec.monitoring.serviceMonitor.enabled
  HorizontalPodAutoscaler or ScaledObject <pool>-prefill, <pool>-decode
                  when autoscaling.policy.type is hpa or keda (see scalers.py); the
                  workers' Deployments then carry no replica count
With autoscaling enabled a role's Deployment stays at 0 replicas (the autoscaler
may bring it back); otherwise a role with 0 replicas renders nothing.
Not rendered here, since it holds a random value: the Secret <pool>-internal with the
pool's internal credential (`credential_secret`), which the reconciler creates once
and the router and workers mount.

routing.json (the router's `--config`): `pdserve.protocol.routing.RoutingTable`, the one
schema the router parses (published as docs/routing.schema.json).

Revisions: a role with the canary strategy names what its pods run
(`worker_revision`: a digest of the pod template); its Deployments are named by
revision, their pods labelled `pdserve.dev/revision` and started with `--revision`.
While a rollout is in progress (`status.rollout`) the role has two Deployments, the
stable revision's and the canary's, with the workers of the rollout's step, and the
routing table splits the role's requests between them by the step's weight. The
stable revision is no longer what the spec says: its Deployment keeps the pod
template it runs (`live`), only its replica count is rendered. A role with the
replace strategy renders exactly `<pool>-<role>`, as if rollouts did not exist.

Command lines come from `worker_args` and `router_args` with a `Wiring`: where the
processes listen and find each other, in the cluster (`cluster_wiring`) or on one
machine (the local backend's), so both run the same flags.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.operator import api
from pdserve.operator.rollout import decision
from pdserve.operator.rollout.revision import revision_name
from pdserve.operator.scaling import scalers
from pdserve.protocol import routing

Obj = dict[str, Any]
Component = Literal["prefill", "decode", "router"]

PORT = 8000
CONFIG_DIR = "/etc/pdserve"
ROUTING_FILE = "routing.json"
CREDENTIAL_DIR = "/var/run/secrets/pdserve"
CREDENTIAL_KEY = "token"
API_KEYS_DIR = "/var/run/secrets/pdserve-api-keys"
API_KEYS_FILE = "keys"
# The root filesystem is read-only: what the processes write (temporary files, caches
# under $HOME such as torch's and Triton's) goes to emptyDir volumes mounted here.
TMP_DIR = "/tmp"
HOME_DIR = "/home/pdserve"
ROUTING_HASH_ANNOTATION = "pdserve.dev/routing-hash"
POOL_LABEL = "pdserve.dev/pool"
REVISION_LABEL = "pdserve.dev/revision"
MANAGER = "pdserve-operator"
RUN_AS = 1000
ROLES = api.ROLES
# A deleted worker pod keeps serving this long before it is told to stop: its endpoint
# is gone from the EndpointSlice at once, and the router's watch needs a moment.
PRE_STOP_SECONDS = 5
EXIT_MARGIN_SECONDS = 5  # after draining, for the engine and the process to end


# --- names and labels ------------------------------------------------------------------


def object_name(pool: str, component: Component | Literal["routing", "internal", "workers"]) -> str:
    """The name of a pool's object: <pool>-prefill, <pool>-decode, <pool>-router, ..."""
    return f"{pool}-{component}"


def selector_labels(pool: str, component: Component) -> dict[str, str]:
    """The labels a component's selector matches (immutable once a Deployment exists)."""
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": pool,
        "app.kubernetes.io/component": component,
    }


def labels(pool: str, component: Component | None = None) -> dict[str, str]:
    """The labels every object of a pool carries (with its component, if any)."""
    base = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": pool}
    if component is not None:
        base = selector_labels(pool, component)
    return {**base, "app.kubernetes.io/managed-by": MANAGER, POOL_LABEL: pool}


def _meta(name: str, namespace: str, object_labels: Mapping[str, str]) -> Obj:
    return {"name": name, "namespace": namespace, "labels": dict(object_labels)}


def router_endpoint(pool: str, namespace: str) -> str:
    """The URL clients use inside the cluster (status.routerEndpoint)."""
    return f"http://{object_name(pool, 'router')}.{namespace}.svc:{PORT}"


def owner_reference(metadata: Mapping[str, Any]) -> Obj:
    """The ownerReference that makes an object belong to the pool (garbage collection)."""
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def with_owner(obj: Obj, metadata: Mapping[str, Any]) -> Obj:
    """A copy of a rendered object owned by the pool with this metadata."""
    meta = {**obj["metadata"], "ownerReferences": [owner_reference(metadata)]}
    return {**obj, "metadata": meta}


# --- command lines ---------------------------------------------------------------------


@dataclass(frozen=True)
class Wiring:
    """Where a pool's processes listen and how they find and trust each other: in a
    cluster (pods, Services, a mounted Secret) or on one machine (local processes)."""

    host: str
    port: int
    credential_file: str  # the pool's internal credential
    kv_transfer_host: str | None = None  # the address a worker's KV agent is reached at
    prefill_peers: tuple[str, ...] = ()  # decode: the prefill workers it may be sent to
    prefill_peers_file: str | None = None  # decode: a file listing more of them
    api_key_file: str | None = None  # router: the keys clients must present


def cluster_wiring(pool: str, namespace: str, spec: api.ServingPoolSpec) -> Wiring:
    """The wiring of a pool's pods: every address, the pod IP advertised for KV
    transfer (the downward API's POD_IP, which Kubernetes expands in args), the
    prefill workers as their headless Service's name, the Secrets mounted."""
    peers: tuple[str, ...] = ()
    if spec.prefill is not None:
        peers = (f"http://{object_name(pool, 'prefill')}.{namespace}.svc:{PORT}",)
    keys = f"{API_KEYS_DIR}/{API_KEYS_FILE}" if spec.router.api_keys is not None else None
    return Wiring(
        host="0.0.0.0",
        port=PORT,
        credential_file=f"{CREDENTIAL_DIR}/{CREDENTIAL_KEY}",
        kv_transfer_host="$(POD_IP)",
        prefill_peers=peers,
        api_key_file=keys,
    )


def worker_args(pool: str, spec: api.ServingPoolSpec, role: api.Role, wiring: Wiring) -> list[str]:
    """`pdserve worker ...` arguments of a role's workers (without the program name)."""
    workers = spec.pool(role)
    assert workers is not None, f"no {role} pool"
    worker_role = spec.worker_role(role)
    model, engine, cache = spec.model, workers.engine, spec.kv_cache
    args = ["worker", "--role", worker_role, "--pool", pool, "--model", model.path]
    args += ["--served-model-name", model.name, "--host", wiring.host, "--port", str(wiring.port)]
    args += ["--dtype", model.dtype, "--device", "cuda" if workers.gpus else "cpu"]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    args += ["--block-size", str(cache.block_size)]
    if cache.hash_seed:
        args += ["--prefix-caching-hash-seed", cache.hash_seed]
    if cache.dtype != "auto":
        args += ["--kv-cache-dtype", cache.dtype]
    args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    args += ["--max-num-seqs", str(engine.max_num_seqs)]
    args += token_budget_args(spec, role)
    if engine.num_kv_blocks is not None:
        args += ["--num-kv-blocks", str(engine.num_kv_blocks)]
    if engine.kv_cache_memory is not None:
        args += ["--kv-cache-memory", str(math.ceil(api.quantity_value(engine.kv_cache_memory)))]
    args += ["--internal-token-file", wiring.credential_file]
    if spec.router.allow_direct_clients:
        args += ["--allow-direct-clients"]
    if worker_role != "both":
        args += ["--kv-transfer", spec.kv_transfer.backend]
        args += ["--transfer-failure-policy", spec.kv_transfer.failure_policy]
        if wiring.kv_transfer_host is not None:
            args += ["--kv-transfer-host", wiring.kv_transfer_host]
    if worker_role == "decode":
        for peer in wiring.prefill_peers:
            args += ["--prefill-peer", peer]
        if wiring.prefill_peers_file is not None:
            args += ["--prefill-peers-file", wiring.prefill_peers_file]
    args += ["--drain-timeout", str(workers.drain_seconds)]
    return args


def token_budget_args(spec: api.ServingPoolSpec, role: api.Role) -> list[str]:
    """The token budget flags of a role's workers. The ITL target (the role's own, else
    the pool's ITL SLO) goes to static workers too: they count the steps over it."""
    workers = spec.pool(role)
    assert workers is not None, f"no {role} pool"
    budget = workers.engine.token_budget
    target = spec.target_itl_ms(role)
    args = [] if target is None else ["--target-itl-ms", f"{round(target, 3):g}"]
    if budget.mode == "adaptive":
        args += ["--token-budget", "adaptive", "--min-budget", str(budget.min_budget)]
        if budget.max_budget is not None:
            args += ["--max-budget", str(budget.max_budget)]
    return args


def router_args(config_path: str, wiring: Wiring) -> list[str]:
    """`pdserve router ...` arguments (without the program name)."""
    args = ["router", "--config", config_path, "--host", wiring.host, "--port", str(wiring.port)]
    args += ["--internal-token-file", wiring.credential_file]
    if wiring.api_key_file is not None:
        args += ["--api-key-file", wiring.api_key_file]
    return args


def routing_table(
    pool: str,
    namespace: str,
    spec: api.ServingPoolSpec,
    discovery: Mapping[str, Any] | None = None,
    revisions: routing.Revisions | None = None,
) -> routing.RoutingTable:
    """The router's configuration, validated as the router will read it.

    Discovery defaults to the pool's headless Services; the local backend passes its
    own (e.g. static URLs). Replica counts are not part of it: scaling a role leaves
    the router alone. `revisions` is the rollouts' split of each role's requests
    (`revision_weights`; none: no split).
    """
    if discovery is None:
        services = {"decode": object_name(pool, "decode")}
        if spec.prefill is not None:
            services["prefill"] = object_name(pool, "prefill")
        discovery = {
            "kind": "kubernetes",
            "namespace": namespace,
            "port": PORT,
            "services": services,
        }
    model = spec.model
    table = {
        "pool": pool,
        "model": {"name": model.name, "path": model.path, "maxModelLen": model.max_model_len},
        "buckets": [
            {"maxInputTokens": b.max_input_tokens, "mode": b.mode} for b in spec.routing.buckets
        ],
        "kvTransfer": {"failurePolicy": spec.kv_transfer.failure_policy},
        "routingPolicy": {
            "type": spec.routing.policy,
            "blockSize": spec.kv_cache.block_size,
            "hashSeed": spec.kv_cache.hash_seed or "",
            "loadWeightTokens": spec.routing.load_weight_tokens,
        },
        "slo": _slo(spec.slo),
        "discovery": dict(discovery),
    }
    if revisions is not None:
        table["revisions"] = revisions.model_dump(mode="json", by_alias=True)
    return routing.RoutingTable.model_validate(table, by_name=False)


def revision_weights(
    spec: api.ServingPoolSpec, rollout: api.RolloutStatus | None
) -> routing.Revisions:
    """Each role's split between its stable and canary revisions while a canary
    rollout is in progress: the step's weight to the canary, the rest to the stable
    revision (so they add up to 100). An ended rollout splits nothing."""
    split: dict[str, list[dict[str, Any]]] = {}
    for role in ROLES:
        status = rollout.role(role) if rollout is not None else None
        if _canary(spec, role) and status is not None and _in_progress(status):
            assert status.canary_revision is not None
            split[role] = [
                {"name": status.stable_revision, "weight": 100 - status.weight},
                {"name": status.canary_revision, "weight": status.weight},
            ]
    return routing.Revisions.model_validate(split)


def _slo(slo: api.SloSpec | None) -> Obj:
    """The targets a request is held to (goodput): TTFT, and the ITL target."""
    targets: Obj = {}
    if slo is not None and slo.ttft is not None:
        targets["ttftSeconds"] = slo.ttft.seconds
    if slo is not None and slo.itl is not None:
        targets["itlSeconds"] = slo.itl.seconds
    return targets


def routing_json(table: routing.RoutingTable) -> str:
    """The routing table as the bytes stored in the ConfigMap."""
    return routing.dump_table(table)


def routing_digest(table: routing.RoutingTable) -> str:
    """What rolls the router's pods when the table changes: everything but the
    revisions' weights, which a rollout changes at every step and the router reads
    from its file as it changes (restarting every router at each step would cut
    their streams for nothing)."""
    unsplit = table.model_copy(update={"revisions": routing.Revisions()})
    return hashlib.sha256(routing_json(unsplit).encode()).hexdigest()[:16]


# --- pods ------------------------------------------------------------------------------


def _probe(path: str, period: int, failures: int, timeout: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _probes() -> Obj:
    # Startup allows 10 minutes for loading a model before liveness may restart it.
    return {
        "startupProbe": _probe("/health", 5, 120, 5),
        "livenessProbe": _probe("/health", 10, 3, 5),
        "readinessProbe": _probe("/ready", 5, 3, 2),
    }


def _resources(placement: api.Placement, gpus: int = 0) -> Obj:
    requests = dict(sorted(placement.resources.requests.items()))
    limits = dict(sorted(placement.resources.limits.items()))
    if gpus:
        limits[api.GPU_RESOURCE] = gpus  # extended resources: requests default to limits
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _env(placement: api.Placement) -> list[Obj]:
    """The pod's identity (for KV transfer agent names) and the user's variables."""
    user = [api.dump(var) for var in placement.env]
    taken = {var["name"] for var in user}

    def field(path: str) -> Obj:
        return {"fieldRef": {"fieldPath": path}}

    builtin: list[Obj] = [
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "POD_IP", "valueFrom": field("status.podIP")},
        {"name": "HOME", "value": HOME_DIR},
    ]
    return [var for var in builtin if var["name"] not in taken] + user


def _writable_volumes() -> tuple[list[Obj], list[Obj]]:
    """The writable folders of a read-only root filesystem, as (volumes, volumeMounts)."""
    folders = {"tmp": TMP_DIR, "home": HOME_DIR}
    volumes = [{"name": name, "emptyDir": {}} for name in folders]
    return volumes, [{"name": name, "mountPath": path} for name, path in folders.items()]


def _credential_volume(pool: str) -> tuple[list[Obj], list[Obj]]:
    """The pool's internal credential (its Secret) as (volumes, volumeMounts)."""
    volume = {
        "name": "credential",
        "secret": {"secretName": object_name(pool, "internal"), "defaultMode": 0o440},
    }
    return [volume], [{"name": "credential", "mountPath": CREDENTIAL_DIR, "readOnly": True}]


def _api_keys_volume(spec: api.ServingPoolSpec) -> tuple[list[Obj], list[Obj]]:
    """The Secret key holding the clients' API keys, as (volumes, volumeMounts)."""
    ref = spec.router.api_keys
    if ref is None:
        return [], []
    source: Obj = {
        "secretName": ref.name,
        "items": [{"key": ref.key, "path": API_KEYS_FILE}],
        "defaultMode": 0o440,
    }
    volume = {"name": "api-keys", "secret": source}
    return [volume], [{"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}]


def _model_volume(spec: api.ServingPoolSpec) -> tuple[list[Obj], list[Obj]]:
    """The model's PVC as (volumes, volumeMounts); empty without claimName."""
    if spec.model.claim_name is None:
        return [], []
    volume = {
        "name": "model",
        "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True},
    }
    return [volume], [{"name": "model", "mountPath": spec.model.mount_path, "readOnly": True}]


def _container(
    name: str,
    spec: api.ServingPoolSpec,
    args: list[str],
    env: list[Obj],
    resources: Obj,
    mounts: list[Obj],
) -> Obj:
    container: Obj = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pdserve"],
        "args": args,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": env,
        **_probes(),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    if resources:
        container["resources"] = resources
    return container


def _pod_spec(placement: api.Placement, container: Obj, volumes: list[Obj]) -> Obj:
    pod: Obj = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 60,  # lets streams in flight finish
        "containers": [container],
        "volumes": volumes,
    }
    if placement.node_selector:
        pod["nodeSelector"] = dict(sorted(placement.node_selector.items()))
    if placement.tolerations:
        pod["tolerations"] = [api.dump(t) for t in placement.tolerations]
    return pod


def _scrape_annotations(spec: api.ServingPoolSpec) -> Obj:
    if not spec.monitoring.scrape_annotations:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
            "prometheus.io/path": "/metrics"}  # fmt: skip


def _deployment(
    pool: str,
    namespace: str,
    component: Component,
    replicas: int | None,
    pod: Obj,
    annotations: Obj,
) -> Obj:
    """A Deployment; `replicas` None leaves the count to an autoscaler (HPA, KEDA)."""
    template_meta: Obj = {"labels": labels(pool, component)}
    template_meta["annotations"] = {
        "kubectl.kubernetes.io/default-container": component,
        **annotations,
    }
    template = {"metadata": template_meta, "spec": pod}
    return _deployment_of(pool, namespace, component, replicas, template)


def _deployment_of(
    pool: str,
    namespace: str,
    component: Component,
    replicas: int | None,
    template: Obj,
    revision: str | None = None,
) -> Obj:
    """A Deployment of a pod template; with a revision, the Deployment of that
    revision of a role: named after it and selecting only its pods."""
    name, object_labels = object_name(pool, component), labels(pool, component)
    selector = selector_labels(pool, component)
    if revision is not None:
        name = revision_deployment_name(pool, revision)
        object_labels = {**object_labels, REVISION_LABEL: revision}
        selector = {**selector, REVISION_LABEL: revision}
    counted = {} if replicas is None else {"replicas": replicas}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, object_labels),
        "spec": {
            **counted,
            "selector": {"matchLabels": selector},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": template,
        },
    }


def _worker_template(pool: str, namespace: str, spec: api.ServingPoolSpec, role: api.Role) -> Obj:
    """The pod template of a role's workers (without a revision).

    A worker told to stop (SIGTERM) drains: readiness fails, it takes no new requests
    and ends those in flight and its KV hand-offs. The preStop pause lets the router
    see the pod go first; the grace period covers the pause and the drain."""
    workers = spec.pool(role)
    assert workers is not None, f"no {role} pool"
    model_volumes, model_mounts = _model_volume(spec)
    credential_volumes, credential_mounts = _credential_volume(pool)
    writable_volumes, writable_mounts = _writable_volumes()
    volumes = [
        {"name": "shm", "emptyDir": {"medium": "Memory"}},  # torch and UCX use /dev/shm
        *writable_volumes,
        *credential_volumes,
        *model_volumes,
    ]
    mounts = [
        {"name": "shm", "mountPath": "/dev/shm"},
        *writable_mounts,
        *credential_mounts,
        *model_mounts,
    ]
    args = worker_args(pool, spec, role, cluster_wiring(pool, namespace, spec))
    env = _env(workers)
    container = _container(role, spec, args, env, _resources(workers, workers.gpus), mounts)
    container["lifecycle"] = {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}}
    pod = _pod_spec(workers, container, volumes)
    pod["automountServiceAccountToken"] = False  # workers never call the API server
    grace = PRE_STOP_SECONDS + workers.drain_seconds + EXIT_MARGIN_SECONDS
    pod["terminationGracePeriodSeconds"] = grace
    annotations = {"kubectl.kubernetes.io/default-container": role, **_scrape_annotations(spec)}
    return {"metadata": {"labels": labels(pool, role), "annotations": annotations}, "spec": pod}


def worker_revision(pool: str, namespace: str, spec: api.ServingPoolSpec, role: api.Role) -> str:
    """The revision of a role's workers: `<role>-<digest>` of their pod template
    (command line, image, environment, resources, volumes, placement), never of how
    many run."""
    return revision_name(role, _worker_template(pool, namespace, spec, role))


def revision_deployment_name(pool: str, revision: str) -> str:
    """The Deployment of one revision of a role: <pool>-<role>-<digest>."""
    return f"{pool}-{revision}"


def worker_deployment(
    pool: str,
    namespace: str,
    spec: api.ServingPoolSpec,
    role: api.Role,
    replicas: int | None,
    revision: str | None = None,
) -> Obj:
    """The Deployment of one role's workers (`replicas` None: an HPA or KEDA sets it);
    with `revision` (the role's `worker_revision`), that revision's Deployment, its
    pods labelled with it and started with `--revision`."""
    template = _worker_template(pool, namespace, spec, role)
    if revision is not None:
        template["metadata"]["labels"][REVISION_LABEL] = revision
        template["spec"]["containers"][0]["args"] += ["--revision", revision]
    return _deployment_of(pool, namespace, role, replicas, template, revision)


def kept_deployment(
    pool: str, namespace: str, role: api.Role, revision: str, replicas: int | None, live: Obj
) -> Obj:
    """The Deployment of a revision the spec no longer describes (the stable one
    during a rollout, or after a rollback): the pod template it runs, at `replicas`."""
    return _deployment_of(pool, namespace, role, replicas, live["spec"]["template"], revision)


def router_deployment(
    pool: str, namespace: str, spec: api.ServingPoolSpec, table: routing.RoutingTable
) -> Obj:
    """The router's Deployment; a routing change rolls it through a hash annotation."""
    model_volumes, model_mounts = _model_volume(spec)
    credential_volumes, credential_mounts = _credential_volume(pool)
    key_volumes, key_mounts = _api_keys_volume(spec)
    writable_volumes, writable_mounts = _writable_volumes()
    config = {"name": "routing", "configMap": {"name": object_name(pool, "routing")}}
    volumes = [config, *writable_volumes, *credential_volumes, *key_volumes, *model_volumes]
    mounts = [
        {"name": "routing", "mountPath": CONFIG_DIR, "readOnly": True},
        *writable_mounts,
        *credential_mounts,
        *key_mounts,
        *model_mounts,
    ]
    wiring = cluster_wiring(pool, namespace, spec)
    args = router_args(f"{CONFIG_DIR}/{ROUTING_FILE}", wiring)
    env = _env(spec.router)
    container = _container("router", spec, args, env, _resources(spec.router), mounts)
    pod = _pod_spec(spec.router, container, volumes)
    pod["serviceAccountName"] = object_name(pool, "router")
    annotations = {ROUTING_HASH_ANNOTATION: routing_digest(table), **_scrape_annotations(spec)}
    return _deployment(pool, namespace, "router", spec.router.replicas, pod, annotations)


# --- services and the rest ---------------------------------------------------------------


def service(pool: str, namespace: str, component: Component, spec: api.ServingPoolSpec) -> Obj:
    """Workers get a headless Service (one DNS record and endpoint per pod); the router
    a normal one of the type the spec asks for."""
    body: Obj = {
        "selector": selector_labels(pool, component),
        "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if component == "router":
        body = {"type": spec.router.service_type, **body}
    else:
        body = {"clusterIP": "None", "publishNotReadyAddresses": False, **body}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(object_name(pool, component), namespace, labels(pool, component)),
        "spec": body,
    }


def pod_disruption_budget(pool: str, namespace: str, component: Component) -> Obj:
    """At most one pod of a component evicted at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(object_name(pool, component), namespace, labels(pool, component)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(pool, component)},
        },
    }


def routing_config_map(pool: str, namespace: str, table: routing.RoutingTable) -> Obj:
    """The ConfigMap holding routing.json."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(object_name(pool, "routing"), namespace, labels(pool, "router")),
        "data": {ROUTING_FILE: routing_json(table)},
    }


def router_access(pool: str, namespace: str) -> list[Obj]:
    """ServiceAccount, Role and RoleBinding letting the router watch EndpointSlices."""
    name = object_name(pool, "router")
    meta = _meta(name, namespace, labels(pool, "router"))
    rule = {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": meta, "rules": [rule]},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def network_policy(
    pool: str, namespace: str, spec: api.ServingPoolSpec, prometheus_namespace: str | None = None
) -> Obj:
    """Who the workers talk to.

    In: the pool's own pods (its router and workers, on any port: KV transfer uses
    ports of its own); the pods of the monitoring namespace (the pool's
    spec.monitoring.prometheusNamespace, else the operator's `prometheus_namespace`)
    on the http port, for /metrics; with spec.router.allowDirectClients, the pods of
    the pool's namespace on the http port. Peers are named by namespace (its
    immutable kubernetes.io/metadata.name label) and the pool's labels, never by a
    label any pod anywhere may carry. The endpoints need the pool's credential besides.

    Out: the pool's own pods, and DNS (port 53 at any address: clusters place their
    resolver differently, CoreDNS pods or a node-local cache). The router is not
    selected: it serves clients and watches the API server, whose address a
    NetworkPolicy can only name as a cluster-specific IP block."""
    members = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": pool}
    workers = {
        "matchLabels": dict(members),
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": list(ROLES)}
        ],
    }
    http = [{"port": "http", "protocol": "TCP"}]
    ingress: list[Obj] = [{"from": [{"podSelector": {"matchLabels": members}}]}]
    monitoring = spec.monitoring.prometheus_namespace or prometheus_namespace
    if monitoring is not None:
        by_name = {"matchLabels": {"kubernetes.io/metadata.name": monitoring}}
        ingress.append({"from": [{"namespaceSelector": by_name}], "ports": http})
    if spec.router.allow_direct_clients:
        ingress.append({"from": [{"podSelector": {}}], "ports": http})
    dns = [{"port": 53, "protocol": protocol} for protocol in ("UDP", "TCP")]
    egress = [{"to": [{"podSelector": {"matchLabels": members}}]}, {"ports": dns}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(object_name(pool, "workers"), namespace, labels(pool)),
        "spec": {
            "podSelector": workers,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


def credential_secret(pool: str, namespace: str, credential: str) -> Obj:
    """The Secret holding the pool's internal credential (made once, by the reconciler,
    with a random value; the router and the workers mount it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(object_name(pool, "internal"), namespace, labels(pool)),
        "type": "Opaque",
        "stringData": {CREDENTIAL_KEY: credential},
    }


def service_monitor(pool: str, namespace: str, spec: api.ServingPoolSpec) -> Obj:
    """A ServiceMonitor scraping /metrics of every Service of the pool."""
    monitor = spec.monitoring.service_monitor
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(
            pool, namespace, {**dict(sorted(monitor.labels.items())), **labels(pool)}
        ),
        "spec": {
            "selector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "pdserve",
                    "app.kubernetes.io/instance": pool,
                }
            },
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": monitor.interval}],
        },
    }


def scaler(
    pool: str,
    namespace: str,
    spec: api.ServingPoolSpec,
    role: api.Role,
    prometheus_url: str | None,
    target: str | None = None,
) -> Obj | None:
    """The HorizontalPodAutoscaler or KEDA ScaledObject of a role (see scalers.py),
    scaling the Deployment `target` (default: the role's); None for KEDA without a
    Prometheus to ask."""
    name = object_name(pool, role)
    deployment = target or name
    meta = _meta(name, namespace, labels(pool, role))
    if spec.autoscaling.policy.type == "hpa":
        body = scalers.hpa_spec(pool, namespace, spec, role, deployment)
        return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": meta, "spec": body}  # fmt: skip
    url = spec.autoscaling.policy.prometheus_url or prometheus_url
    if url is None:
        return None
    body = scalers.scaled_object_spec(pool, namespace, spec, role, deployment, url)
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta,
            "spec": body}  # fmt: skip


# --- the whole pool --------------------------------------------------------------------


def externally_scaled(spec: api.ServingPoolSpec) -> bool:
    """Whether an HPA or KEDA sets the workers' replica counts."""
    return spec.autoscaling.enabled and spec.autoscaling.policy.type != "planner"


def desired_replicas(
    spec: api.ServingPoolSpec, overrides: Mapping[api.Role, int] | None = None
) -> dict[Component, int]:
    """Replicas per component: the spec's, or the autoscaler's where it decided, kept
    within the autoscaling bounds when autoscaling is enabled."""
    counts: dict[Component, int] = {}
    for role in ROLES:
        workers = spec.pool(role)
        wanted = 0 if workers is None else (overrides or {}).get(role, workers.replicas)
        if workers is not None and spec.autoscaling.enabled:
            bounds = spec.autoscaling.bounds(role)
            wanted = min(max(wanted, bounds.min_replicas), bounds.max_replicas)
        counts[role] = wanted
    counts["router"] = spec.router.replicas
    return counts


def rendered_roles(spec: api.ServingPoolSpec, counts: Mapping[Component, int]) -> list[api.Role]:
    """The roles that have a Deployment: any with workers, and every role of a pool
    with autoscaling (its Deployment may be scaled to 0 and back)."""
    return [
        role
        for role in ROLES
        if spec.pool(role) is not None and (counts[role] > 0 or spec.autoscaling.enabled)
    ]


def _canary(spec: api.ServingPoolSpec, role: api.Role) -> bool:
    workers = spec.pool(role)
    return workers is not None and workers.rollout.type == "canary"


def _in_progress(status: api.RoleRolloutStatus) -> bool:
    return status.phase in decision.ACTIVE and status.canary_revision is not None


def worker_deployments(
    pool: str,
    namespace: str,
    spec: api.ServingPoolSpec,
    role: api.Role,
    replicas: int | None,
    rollout: api.RoleRolloutStatus | None = None,
    live: Mapping[str, Obj] | None = None,
) -> list[Obj]:
    """A role's Deployments: `<pool>-<role>` with the replace strategy; with canary,
    one per revision: the stable and the canary's while a rollout is in progress
    (the step's workers each), else the stable revision's alone. `live` holds the
    live Deployments by name: a revision the spec no longer describes keeps the pod
    template it runs there (absent there, it cannot be rendered: the spec's revision
    takes its place)."""
    if not _canary(spec, role):
        return [worker_deployment(pool, namespace, spec, role, replicas)]
    workers = spec.pool(role)
    assert workers is not None
    desired = worker_revision(pool, namespace, spec, role)
    found = live or {}

    def deployment(revision: str, count: int | None) -> Obj | None:
        if revision == desired:
            return worker_deployment(pool, namespace, spec, role, count, desired)
        kept = found.get(revision_deployment_name(pool, revision))
        if kept is None:
            return None
        return kept_deployment(pool, namespace, role, revision, count, kept)

    if rollout is None:
        return [worker_deployment(pool, namespace, spec, role, replicas, desired)]
    if not _in_progress(rollout):
        only = deployment(rollout.stable_revision, replicas)
        return [only or worker_deployment(pool, namespace, spec, role, replicas, desired)]
    assert rollout.canary_revision is not None
    # An autoscaler (HPA, KEDA) scales the stable revision; the canary's share is of
    # the spec's count.
    total = workers.replicas if replicas is None else replicas
    canary_count = decision.canary_workers(workers.rollout, rollout, total)
    stable_count = None if replicas is None else decision.stable_workers(
        workers.rollout, rollout, total
    )  # fmt: skip
    both = (
        deployment(rollout.stable_revision, stable_count),
        deployment(rollout.canary_revision, canary_count),
    )
    return [obj for obj in both if obj is not None]


def scaled_deployment(
    pool: str,
    namespace: str,
    spec: api.ServingPoolSpec,
    role: api.Role,
    rollout: api.RolloutStatus | None,
) -> str:
    """The name of the Deployment an HPA or KEDA scales: the role's, or its stable
    revision's (the spec's before any rollout status)."""
    if not _canary(spec, role):
        return object_name(pool, role)
    status = rollout.role(role) if rollout is not None else None
    if status is None:
        return revision_deployment_name(pool, worker_revision(pool, namespace, spec, role))
    return revision_deployment_name(pool, status.stable_revision)


def render(
    pool: str,
    namespace: str,
    spec: api.ServingPoolSpec,
    replicas: Mapping[api.Role, int] | None = None,
    *,
    prometheus_url: str | None = None,
    prometheus_namespace: str | None = None,
    rollout: api.RolloutStatus | None = None,
    live: Mapping[str, Obj] | None = None,
) -> list[Obj]:
    """Every object of a pool, in apply order. `replicas` overrides the spec's counts
    (the planner's decisions); `prometheus_url` is the Prometheus KEDA asks, and
    `prometheus_namespace` where the Prometheus scraping the pool runs, when the pool
    names none. `rollout` is the pool's `status.rollout` and `live` its live
    Deployments by name (see `worker_deployments`)."""
    counts = desired_replicas(spec, replicas)
    roles = rendered_roles(spec, counts)
    external = externally_scaled(spec)
    with_router = counts["router"] > 0
    table = routing_table(pool, namespace, spec, revisions=revision_weights(spec, rollout))
    objects: list[Obj] = []
    if with_router:
        objects += [routing_config_map(pool, namespace, table), *router_access(pool, namespace)]
    components: list[Component] = [*roles, "router"] if with_router else [*roles]
    objects += [service(pool, namespace, c, spec) for c in components]
    if roles:
        objects.append(network_policy(pool, namespace, spec, prometheus_namespace))
    for role in roles:
        count = None if external else counts[role]
        status = rollout.role(role) if rollout is not None else None
        objects += worker_deployments(pool, namespace, spec, role, count, status, live)
    if with_router:
        objects.append(router_deployment(pool, namespace, spec, table))
    objects += [pod_disruption_budget(pool, namespace, c) for c in components]
    if spec.monitoring.service_monitor.enabled:
        objects.append(service_monitor(pool, namespace, spec))
    if external:
        for role in roles:
            target = scaled_deployment(pool, namespace, spec, role, rollout)
            obj = scaler(pool, namespace, spec, role, prometheus_url, target)
            if obj is not None:
                objects.append(obj)
    return objects
