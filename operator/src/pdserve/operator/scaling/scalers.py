"""What a HorizontalPodAutoscaler or a KEDA ScaledObject of a role says, for clusters
that scale with them instead of the operator's planner (`autoscaling.policy.type`
hpa or keda). Pure: the `spec` of each; render.py wraps them into objects.

Both follow the same signals as the planner (planner.py), with the same thresholds:

  prefill  TTFT of disaggregated requests at the SLO's percentile (target: the SLO),
           requests waiting per prefill worker (target: prefillQueueHigh)
  decode   ITL at its percentile, TTFT of colocated requests (all requests without a
           prefill pool), KV cache usage (target: kvCacheUsageHigh)

and the same bounds, stabilisation windows and steps (`behavior`). What neither can
do: hold scaling while Prometheus has no data, or bound prefill per decode workers.

KEDA's triggers carry the PromQL itself. An HPA reads external metrics, which an
external metrics adapter must serve under the names below, each selected by the
labels `pool` and `namespace` (and `mode` or `role` where given); e.g. for
prometheus-adapter, an external rule per name whose metricsQuery is the query of
promql.py (`PoolQueries`) with <<.LabelMatchers>> as its selector:

  pdserve_time_to_first_token_seconds_p<P>   TTFT at percentile P (95, 99_9), by mode
  pdserve_inter_token_latency_seconds_p<P>   ITL at percentile P
  pdserve_requests_waiting_per_worker        requests waiting per worker, by role
  pdserve_kv_cache_usage_ratio_per_worker    KV cache usage per worker, by role
"""

from __future__ import annotations

from typing import Any

from pdserve.operator import api
from pdserve.operator.scaling.promql import PoolQueries

Obj = dict[str, Any]

PERIOD_MAX_SECONDS = 1800  # the longest periodSeconds of an HPA's scaling policy


def percentile_name(percentile: float) -> str:
    """`p95`, `p99_9`: a percentile as part of a metric name."""
    return "p" + f"{percentile:g}".replace(".", "_")


def behavior(policy: api.ScalingPolicy) -> Obj:
    """The HPA `behavior` of the policy: its windows, and its steps once per cooldown."""
    period = max(1, min(PERIOD_MAX_SECONDS, policy.cooldown_seconds or policy.interval_seconds))

    def direction(window: int, step: int) -> Obj:
        return {
            "stabilizationWindowSeconds": window,
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": step, "periodSeconds": period}],
        }

    return {
        "scaleUp": direction(policy.scale_up_stabilization_seconds, policy.max_scale_up_step),
        "scaleDown": direction(policy.scale_down_stabilization_seconds, policy.max_scale_down_step),
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity of a fraction: 0.05 -> "50m" (quantities hold 3 decimals)."""
    return f"{round(value * 1000)}m"


def _ttft_modes(spec: api.ServingPoolSpec, role: api.Role) -> tuple[str | None, ...]:
    """The modes whose TTFT a role answers for (None: all of them)."""
    if role == "prefill":
        return ("disaggregated",)
    return ("colocated",) if spec.prefill is not None else (None,)


def external_metrics(
    pool: str, namespace: str, spec: api.ServingPoolSpec, role: api.Role
) -> list[Obj]:
    """The HPA's metrics of a role: External, selected by pool and namespace."""
    policy, slo = spec.autoscaling.policy, spec.slo or api.SloSpec()
    base = {"pool": pool, "namespace": namespace}

    def metric(name: str, labels: dict[str, str], target: Obj) -> Obj:
        selector = {"matchLabels": {**base, **labels}}
        return {"type": "External", "external": {"metric": {"name": name, "selector": selector},
                                                 "target": target}}  # fmt: skip

    def value(threshold: float) -> Obj:
        return {"type": "Value", "value": _quantity(threshold)}

    out = []
    if slo.ttft is not None:
        name = f"pdserve_time_to_first_token_seconds_{percentile_name(slo.ttft.percentile)}"
        for mode in _ttft_modes(spec, role):
            labels = {} if mode is None else {"mode": mode}
            out.append(metric(name, labels, value(slo.ttft.seconds)))
    if role == "prefill":
        queue = value(policy.prefill_queue_high)
        out.append(metric("pdserve_requests_waiting_per_worker", {"role": "prefill"}, queue))
        return out
    if slo.itl is not None:
        name = f"pdserve_inter_token_latency_seconds_{percentile_name(slo.itl.percentile)}"
        out.append(metric(name, {}, value(slo.itl.seconds)))
    usage = value(policy.kv_cache_usage_high)
    out.append(
        metric(
            "pdserve_kv_cache_usage_ratio_per_worker", {"role": spec.worker_role("decode")}, usage
        )
    )
    return out


def hpa_spec(
    pool: str, namespace: str, spec: api.ServingPoolSpec, role: api.Role, deployment: str
) -> Obj:
    """The spec of a role's HorizontalPodAutoscaler (autoscaling/v2)."""
    bounds = spec.autoscaling.bounds(role)
    return {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
        "minReplicas": bounds.min_replicas,
        "maxReplicas": bounds.max_replicas,
        "metrics": external_metrics(pool, namespace, spec, role),
        "behavior": behavior(spec.autoscaling.policy),
    }


def keda_triggers(
    pool: str, namespace: str, spec: api.ServingPoolSpec, role: api.Role, url: str
) -> list[Obj]:
    """KEDA prometheus triggers of a role: the planner's queries and thresholds."""
    policy, slo = spec.autoscaling.policy, spec.slo or api.SloSpec()
    queries = PoolQueries(pool, namespace, policy.window_seconds)

    def trigger(name: str, query: str, threshold: float) -> Obj:
        metadata = {"serverAddress": url, "query": query, "threshold": f"{threshold:g}",
                    "ignoreNullValues": "true"}  # fmt: skip
        return {"type": "prometheus", "name": name, "metricType": "Value", "metadata": metadata}

    out = []
    if slo.ttft is not None:
        quantile = slo.ttft.percentile / 100
        for mode in _ttft_modes(spec, role):
            query = queries.ttft_quantile(quantile, mode)
            query = query if mode is not None else f"max({query})"
            out.append(trigger(f"ttft-{mode or 'all'}", query, slo.ttft.seconds))
    if role == "prefill":
        waiting = queries.role_average("pdserve_requests_waiting", 'role="prefill"')
        out.append(trigger("prefill-queue", waiting, policy.prefill_queue_high))
        return out
    if slo.itl is not None:
        out.append(trigger("itl", queries.itl_quantile(slo.itl.percentile / 100), slo.itl.seconds))
    usage = queries.role_average("pdserve_kv_cache_usage_ratio", 'role=~"decode|both"')
    out.append(trigger("kv-cache-usage", usage, policy.kv_cache_usage_high))
    return out


def scaled_object_spec(
    pool: str, namespace: str, spec: api.ServingPoolSpec, role: api.Role, deployment: str, url: str
) -> Obj:
    """The spec of a role's KEDA ScaledObject (keda.sh/v1alpha1); KEDA makes the HPA,
    named like the Deployment."""
    bounds, policy = spec.autoscaling.bounds(role), spec.autoscaling.policy
    return {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
        "pollingInterval": policy.interval_seconds,
        "cooldownPeriod": policy.scale_down_stabilization_seconds,
        "minReplicaCount": bounds.min_replicas,
        "maxReplicaCount": bounds.max_replicas,
        "advanced": {
            "horizontalPodAutoscalerConfig": {"name": deployment, "behavior": behavior(policy)}
        },
        "triggers": keda_triggers(pool, namespace, spec, role, url),
    }
