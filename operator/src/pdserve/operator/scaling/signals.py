"""Reading a pool's signals from Prometheus: the planner's observation and the
disaggregation condition's rates, from the queries of promql.py (run concurrently).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.operator import api
from pdserve.operator.scaling import disaggregation, planner
from pdserve.operator.scaling.prometheus import Prometheus
from pdserve.operator.scaling.promql import PoolQueries


class NoMetricsError(Exception):
    """Prometheus answers, but holds no series of the pool."""


@dataclass(frozen=True)
class PoolSignals:
    """What Prometheus says about a pool."""

    observation: planner.Observation
    disaggregation: disaggregation.Signals


def _worker_role(label: str) -> api.Role | None:
    """The planner's role of a worker's `role` label (both: a decode worker that
    prefills too)."""
    if label == "prefill":
        return "prefill"
    return "decode" if label in ("decode", "both") else None


def _loads(
    workers: dict[str, float],
    waiting: dict[str, float],
    running: dict[str, float],
    kv_usage: dict[str, float],
) -> dict[api.Role, planner.RoleLoad]:
    loads = {}
    for label, count in workers.items():
        role = _worker_role(label)
        if role is not None:
            loads[role] = planner.RoleLoad(
                workers=int(count),
                waiting=waiting.get(label, 0.0),
                running=running.get(label, 0.0),
                kv_cache_usage=kv_usage.get(label, 0.0),
            )
    return loads


async def _values(prometheus: Prometheus, queries: dict[str, str]) -> dict[str, float | None]:
    answers = await asyncio.gather(*(prometheus.value(q) for q in queries.values()))
    return dict(zip(queries, answers, strict=True))


async def _labeled(
    prometheus: Prometheus, queries: dict[str, tuple[str, str]]
) -> dict[str, dict[str, float]]:
    answers = await asyncio.gather(*(prometheus.by_label(q, key) for q, key in queries.values()))
    return dict(zip(queries, answers, strict=True))


async def read(
    prometheus: Prometheus, queries: PoolQueries, slo: api.SloSpec | None
) -> PoolSignals:
    """The pool's signals; NoMetricsError when Prometheus has none of its series,
    PrometheusError when it cannot be asked."""
    if not await prometheus.value(queries.reporting()):
        where = f" in namespace {queries.namespace}" if queries.namespace else ""
        raise NoMetricsError(f"{prometheus.url} has no series of pool {queries.pool}{where}")
    slo = slo or api.SloSpec()
    ttft_q = (slo.ttft.percentile if slo.ttft else 95.0) / 100
    itl_q = (slo.itl.percentile if slo.itl else 95.0) / 100
    values, labeled = await asyncio.gather(
        _values(prometheus, {
            "itl": queries.itl_quantile(itl_q),
            "requests": queries.requests(),
            "rate": queries.request_rate(),
            "routed": queries.disaggregated_routed(),
            "served": queries.disaggregated_served(),
            "transfers": queries.transfers(),
            "prefill": queries.prefill_available(),
        }),
        _labeled(prometheus, {
            "ttft": (queries.ttft_quantile(ttft_q), "mode"),
            "workers": (queries.workers(), "role"),
            "waiting": (queries.per_worker("pdserve_requests_waiting"), "role"),
            "running": (queries.per_worker("pdserve_requests_running"), "role"),
            "kv": (queries.per_worker("pdserve_kv_cache_usage_ratio"), "role"),
            "fallbacks": (queries.fallbacks(), "reason"),
            "failures": (queries.transfer_failures(), "reason"),
        }),
    )  # fmt: skip
    loads = _loads(labeled["workers"], labeled["waiting"], labeled["running"], labeled["kv"])
    ttft: dict[planner.Mode, float] = {}
    for mode, value in labeled["ttft"].items():
        if mode in ("colocated", "disaggregated"):
            ttft[mode] = value  # type: ignore[index]
    observation = planner.Observation(
        request_rate=values["rate"],
        requests=values["requests"],
        disaggregated_rate=values["routed"],
        ttft=ttft,
        itl=values["itl"],
        prefill=loads.get("prefill"),
        decode=loads.get("decode"),
    )
    signals = disaggregation.Signals(
        routed=values["routed"],
        served=values["served"],
        fallbacks=labeled["fallbacks"],
        transfers=values["transfers"],
        failures=labeled["failures"],
        prefill_available=values["prefill"] or 0.0,
    )
    return PoolSignals(observation, signals)
