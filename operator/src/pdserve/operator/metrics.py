"""The operator's own Prometheus metrics (how often and how fast it reconciles).

Label sets stay small: `trigger` is what started a reconcile (create, update, resume,
child: an owned object changed, retry: a write was refused, resync: the periodic
resync), `reason` a short error class, `verb` and `resource` the operator's API
requests. No label names a pool, but for the rollouts' (`pdserve_rollout_*`, the same
names a local pool exports; `pool_namespace` is the pool's namespace, as `namespace`
is the operator's own once Prometheus scrapes it): a deleted pool's gauges go.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pdserve.operator.rollout.metrics import RolloutMetrics

RECONCILES = Counter(
    "pdserve_operator_reconciles_total",
    "ServingPool reconciles, by what started them.",
    ["trigger"],
)
RECONCILE_ERRORS = Counter(
    "pdserve_operator_reconcile_errors_total",
    "Reconciles that failed, by what started them and why.",
    ["trigger", "reason"],
)
RECONCILE_DURATION = Histogram(
    "pdserve_operator_reconcile_duration_seconds",
    "Time to reconcile one ServingPool (render, apply, prune, status).",
    ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
OBJECT_CHANGES = Counter(
    "pdserve_operator_object_changes_total",
    "Child objects the operator created, updated or deleted, by kind.",
    ["kind", "action"],
)
WATCH_EVENTS = Counter(
    "pdserve_operator_watch_events_total",
    "Watch events on pools' child objects that the operator looked at, by kind.",
    ["kind"],
)
API_REQUESTS = Counter(
    "pdserve_operator_api_requests_total",
    "Requests the operator's reconciler sent to the API server (kopf's watches aside).",
    ["verb", "resource"],
)

SCALING_ROUNDS = Counter(
    "pdserve_operator_scaling_rounds_total",
    "Autoscaler rounds (one per pool and interval), by what Prometheus gave: ok, "
    "unreachable, no_metrics (no series of the pool), no_url (no Prometheus configured).",
    ["result"],
)
SCALING_DECISIONS = Counter(
    "pdserve_operator_scaling_decisions_total",
    "Replica changes the planner decided, by role, direction (up, down) and reason.",
    ["role", "direction", "reason"],
)

ROLLOUT = RolloutMetrics(REGISTRY)

POOLS = Gauge(
    "pdserve_operator_pools",
    "ServingPools the operator holds state for (a deleted pool leaves it).",
)
RETRIES_PENDING = Gauge(
    "pdserve_operator_retries_pending",
    "ServingPools waiting to be reconciled again after a refused write.",
)


def app() -> web.Application:
    """The operator's HTTP endpoints: /metrics, and /healthz and /readyz for the
    kubelet's probes (they answer while the operator's event loop runs)."""

    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    application = web.Application()
    application.router.add_get("/metrics", prometheus)
    application.router.add_get("/healthz", ok)
    application.router.add_get("/readyz", ok)
    return application
