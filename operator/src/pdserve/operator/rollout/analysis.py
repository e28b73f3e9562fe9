"""A rollout step's analysis: the canary's and the stable revision's figures from
Prometheus over the same window, per input-length bucket, and the rollback conditions
judged on them (`conditions`).

The window is the step's, from `stepStartedTime` to now. Each condition looks at the
last `durationSeconds` of it ("held for durationSeconds"), clipped to the window; a
duration of 0 looks at the whole window. The figures come from the router's
per-request metrics, labelled with the revisions that served each request
(`prefill_revision`, `decode_revision`), and from the workers' engine metrics,
labelled `revision`: no scrape configuration is needed beyond the pool's own.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from pdserve.operator.api import (
    RevisionFigures,
    RoleRolloutStatus,
    RollbackCondition,
    RollbackConditionName,
    RollbackConditions,
    RolloutStrategy,
)
from pdserve.operator.rollout.conditions import judge
from pdserve.operator.rollout.decision import Analysis, Breach
from pdserve.operator.scaling.prometheus import Prometheus, PrometheusError, finite
from pdserve.operator.scaling.promql import ITL, TTFT, PoolQueries
from pdserve.protocol.routing import Role, Slo

E2E = "pdserve_e2e_request_latency_seconds"
ALL = "all"  # the key of figures over every bucket
CONDITIONS: tuple[RollbackConditionName, ...] = (
    "itlOverTarget",
    "preemptionsWithTtft",
    "shortRequestsSlowed",
    "utilisationUpGoodputDown",
    "errorRates",
)
_WORKER_ROLES = {"prefill": 'role="prefill"', "decode": 'role=~"decode|both"'}


@dataclass(frozen=True)
class RevisionQueries:
    """The PromQL of one revision of one role's figures over one range."""

    queries: PoolQueries  # the pool's selector, and the range as its window
    role: Role
    revision: str

    def _router(self, *matchers: str) -> str:
        label = f"{self.role}_revision"
        return self.queries.select('role="router"', f'{label}="{self.revision}"', *matchers)

    def _workers(self, *matchers: str) -> str:
        own = f'revision="{self.revision}"'
        return self.queries.select(_WORKER_ROLES[self.role], own, *matchers)

    def _by(self, grouped: bool, *more: str) -> str:
        return ", ".join((["bucket"] if grouped else []) + list(more))

    def outcomes(self, grouped: bool) -> str:
        """Requests that ended in the range, by outcome (and bucket)."""
        return (
            f"sum by ({self._by(grouped, 'outcome')}) "
            f"(increase(pdserve_router_requests_total{self._router()}{self.queries.window}))"
        )

    def slo_met(self, grouped: bool) -> str:
        """Requests that met every SLO in the range."""
        by = self._by(grouped)
        return (
            f"sum by ({by}) "
            f"(increase(pdserve_router_slo_met_total{self._router()}{self.queries.window}))"
        )

    def quantile(self, histogram: str, quantile: float, grouped: bool) -> str:
        """A latency's quantile over the range."""
        by = self._by(grouped, "le")
        return (
            f"histogram_quantile({quantile:g}, sum by ({by}) "
            f"(rate({histogram}_bucket{self._router()}{self.queries.window})))"
        )

    def preemptions(self) -> str:
        """Preemptions in the revision's workers over the range."""
        return f"sum(increase(pdserve_preemptions_total{self._workers()}{self.queries.window}))"

    def timeouts(self) -> str:
        """Requests the revision's workers refused for waiting too long."""
        refused = self._workers('reason="queue_timeout"')
        return f"sum(increase(pdserve_requests_rejected_total{refused}{self.queries.window}))"

    def kv_usage(self) -> str:
        """The revision's workers' KV cache usage, averaged over the range."""
        gauge = f"pdserve_kv_cache_usage_ratio{self._workers()}"
        return f"avg(avg_over_time({gauge}{self.queries.window}))"


async def analyse(
    prometheus: Prometheus,
    pool: str,
    role: Role,
    status: RoleRolloutStatus,
    strategy: RolloutStrategy,
    slo: Slo,
    buckets: Sequence[str],
    now: datetime,
    namespace: str | None = None,
) -> Analysis | None:
    """The current step's analysis of a role's rollout: both revisions' figures over
    the step's window so far, and the conditions that fired (per bucket of `buckets`,
    the routing table's labels, the first holding short requests); None when
    Prometheus cannot be asked or there is no canary."""
    canary = status.canary_revision
    if canary is None:
        return None
    window = _window_seconds(status, now)
    ranges = {_range(strategy.conditions, name, window) for name in _enabled(strategy)}
    revisions = (status.stable_revision, canary)
    try:
        summary, by_range = await asyncio.gather(
            _both(prometheus, pool, namespace, role, revisions, window, False),
            asyncio.gather(*(
                _both(prometheus, pool, namespace, role, revisions, r, True)
                for r in sorted(ranges)
            )),
        )  # fmt: skip
    except PrometheusError:
        return None
    figures = dict(zip(sorted(ranges), by_range, strict=True))
    breaches = tuple(_breaches(strategy, slo, buckets, window, figures))
    baseline, canary_figures = (figures_of.get(ALL, RevisionFigures()) for figures_of in summary)
    return Analysis(canary=canary_figures, baseline=baseline, breaches=breaches)


def _breaches(
    strategy: RolloutStrategy,
    slo: Slo,
    buckets: Sequence[str],
    window: int,
    figures: dict[int, tuple[dict[str, RevisionFigures], dict[str, RevisionFigures]]],
) -> list[Breach]:
    found = []
    for name in _enabled(strategy):
        stable, canary = figures[_range(strategy.conditions, name, window)]
        for index, bucket in enumerate(buckets):
            breach = judge(
                name, strategy.conditions, slo, bucket, index == 0,
                canary.get(bucket, RevisionFigures()), stable.get(bucket, RevisionFigures()),
            )  # fmt: skip
            if breach is not None:
                found.append(breach)
    return found


def _enabled(strategy: RolloutStrategy) -> list[RollbackConditionName]:
    return [name for name in CONDITIONS if _rule(strategy.conditions, name).enabled]


def _rule(conditions: RollbackConditions, name: RollbackConditionName) -> RollbackCondition:
    field = {
        "itlOverTarget": conditions.itl_over_target,
        "preemptionsWithTtft": conditions.preemptions_with_ttft,
        "shortRequestsSlowed": conditions.short_requests_slowed,
        "utilisationUpGoodputDown": conditions.utilisation_up_goodput_down,
        "errorRates": conditions.error_rates,
    }
    return field[name]


def _range(conditions: RollbackConditions, name: RollbackConditionName, window: int) -> int:
    """The seconds a condition looks back: its duration, clipped to the window (the
    whole window for a duration of 0)."""
    duration = _rule(conditions, name).duration_seconds
    return window if duration == 0 else max(1, min(duration, window))


def _window_seconds(status: RoleRolloutStatus, now: datetime) -> int:
    started = status.step_started_time
    if started is None:
        return 60
    return max(1, math.ceil((now - started).total_seconds()))


async def _both(
    prometheus: Prometheus,
    pool: str,
    namespace: str | None,
    role: Role,
    revisions: tuple[str, str],
    seconds: int,
    grouped: bool,
) -> tuple[dict[str, RevisionFigures], dict[str, RevisionFigures]]:
    """The stable and the canary revision's figures over the last `seconds`."""
    queries = PoolQueries(pool, namespace, seconds)
    stable, canary = await asyncio.gather(*(
        revision_figures(prometheus, RevisionQueries(queries, role, name), grouped)
        for name in revisions
    ))  # fmt: skip
    return stable, canary


async def revision_figures(
    prometheus: Prometheus, queries: RevisionQueries, grouped: bool
) -> dict[str, RevisionFigures]:
    """One revision's figures over the range, by bucket (`grouped`) or over all of
    them (key `all`); PrometheusError when it cannot be asked."""
    key = "bucket" if grouped else ""
    outcomes, latencies, workers = await asyncio.gather(
        prometheus.query(queries.outcomes(grouped)),
        asyncio.gather(
            prometheus.by_label(queries.slo_met(grouped), key),
            *(
                prometheus.by_label(queries.quantile(histogram, quantile, grouped), key)
                for histogram, quantile in ((ITL, 0.99), (TTFT, 0.95), (TTFT, 0.99), (E2E, 0.95))
            ),
        ),
        asyncio.gather(
            prometheus.value(queries.preemptions()),
            prometheus.value(queries.timeouts()),
            prometheus.value(queries.kv_usage()),
        ),
    )
    met, itl, ttft95, ttft99, e2e95 = latencies
    preempted, timeouts, usage = workers
    counts: dict[str, dict[str, float]] = {}
    for sample in outcomes:
        value = finite(sample.value)
        if value is not None:
            bucket = sample.labels.get("bucket", "") if grouped else ""
            counts.setdefault(bucket, {})[sample.labels.get("outcome", "")] = value
    total = sum(sum(by_outcome.values()) for by_outcome in counts.values())
    figures: dict[str, RevisionFigures] = {}
    for bucket in set(counts) | set(itl) | set(ttft95) | set(e2e95):
        by_outcome = counts.get(bucket, {})
        requests = sum(by_outcome.values())
        figures[bucket if grouped else ALL] = RevisionFigures(
            requests=requests,
            itl_p99_seconds=itl.get(bucket),
            ttft_p95_seconds=ttft95.get(bucket),
            ttft_p99_seconds=ttft99.get(bucket),
            short_e2e_p95_seconds=e2e95.get(bucket),
            preemption_rate=_share(preempted, total),
            goodput=_share(met.get(bucket, 0.0), requests),
            kv_cache_usage=usage,
            error_rate=_share(by_outcome.get("error", 0.0), requests),
            cancel_rate=_share(by_outcome.get("cancelled", 0.0), requests),
            timeout_rate=_share(timeouts, total),
        )
    return figures


def _share(part: float | None, whole: float) -> float | None:
    """`part` of `whole` (None: no requests to share by, or no figure)."""
    if part is None or whole <= 0:
        return None
    return part / whole
