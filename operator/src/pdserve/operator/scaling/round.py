"""One scaling round, wherever a pool runs: what Prometheus says about the pool (or
why it says nothing), the conditions that follow, and the planner's decisions as the
pool's autoscaling status. The operator (scaling/autoscaler.py) and the local pool
(local/scaling.py) run these rounds in loops of their own and act on the decisions
their own way: Deployments' replicas, or worker processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp

from pdserve.operator import api, render
from pdserve.operator.controller.status import Verdict
from pdserve.operator.scaling import disaggregation, planner
from pdserve.operator.scaling.prometheus import Prometheus, PrometheusError
from pdserve.operator.scaling.promql import PoolQueries
from pdserve.operator.scaling.signals import NoMetricsError, PoolSignals, read

URL_FIX = "set the operator's --prometheus-url or spec.autoscaling.policy.prometheusUrl"


def planner_scales(spec: api.ServingPoolSpec) -> bool:
    """Whether the operator's planner sets the workers' replica counts."""
    autoscaling = spec.autoscaling
    return autoscaling.enabled and autoscaling.policy.type == "planner"


@dataclass(frozen=True)
class Reading:
    """What a round learnt from Prometheus."""

    signals: PoolSignals | None  # None: nothing to act on
    conditions: dict[api.ConditionType, Verdict]
    result: str  # ok, unreachable, no_metrics, no_url, idle (nothing to read)


def _unable(
    spec: api.ServingPoolSpec, reason: str, message: str
) -> dict[api.ConditionType, Verdict]:
    conditions: dict[api.ConditionType, Verdict] = {}
    if planner_scales(spec):
        conditions["ScalingActive"] = Verdict("False", reason, f"{message}; not scaling")
    if spec.routing.disaggregated:
        conditions["DisaggregationActive"] = Verdict("Unknown", reason, message)
    return conditions


async def read_pool(
    session: aiohttp.ClientSession,
    url: str | None,
    queries: PoolQueries,
    spec: api.ServingPoolSpec,
    url_fix: str = URL_FIX,
) -> Reading:
    """Ask Prometheus at `url` about the pool; the conditions say what came of it
    (`url_fix`: how to give one, where there is none)."""
    planning, watching = planner_scales(spec), spec.routing.disaggregated
    if not (planning or watching):
        return Reading(None, {}, "idle")
    if url is None:
        return Reading(
            None, _unable(spec, "NoPrometheusUrl", f"no Prometheus: {url_fix}"), "no_url"
        )
    try:
        signals = await read(Prometheus(url, session), queries, spec.slo)
    except PrometheusError as error:
        return Reading(None, _unable(spec, "PrometheusUnreachable", str(error)), "unreachable")
    except NoMetricsError as error:
        why = f"{error}: check that it scrapes the pool (a ServiceMonitor, or scrape annotations)"
        return Reading(None, _unable(spec, "NoMetrics", why), "no_metrics")
    conditions: dict[api.ConditionType, Verdict] = {}
    policy = spec.autoscaling.policy
    if watching:
        conditions["DisaggregationActive"] = disaggregation.verdict(
            signals.disaggregation, policy.window_seconds
        )
    if planning:
        conditions["ScalingActive"] = Verdict(
            "True", "MetricsAvailable", f"deciding every {policy.interval_seconds}s from {url}"
        )
    return Reading(signals, conditions, "ok")


# --- decisions -----------------------------------------------------------------------------


def when(timestamp: float) -> datetime:
    """A planner time (seconds since the epoch) as the status writes it."""
    return datetime.fromtimestamp(timestamp, UTC).replace(microsecond=0)


def remembered(autoscaling: api.AutoscalingStatus | None, now: float) -> planner.Memory:
    """The planner's memory after a restart: when each role last changed (from the
    status), watching from now (a scale-down waits for a whole window)."""
    last_scale: dict[api.Role, float] = {}
    for role in render.ROLES:
        decided = autoscaling.role(role) if autoscaling else None
        if decided is not None and decided.last_scale_time is not None:
            last_scale[role] = decided.last_scale_time.timestamp()
    return planner.Memory(since=now, last_scale=last_scale)


@dataclass(frozen=True)
class Outcome:
    """The planner's decisions, the autoscaling status that records them, and its memory."""

    decisions: dict[api.Role, planner.Decision]
    autoscaling: api.AutoscalingStatus
    memory: planner.Memory

    @property
    def changes(self) -> dict[api.Role, int]:
        """The new replica counts of the roles that change."""
        return {r: d.desired for r, d in self.decisions.items() if d.direction != "none"}


def role_status(
    previous: api.RoleScalingStatus | None, decision: planner.Decision, now: float
) -> api.RoleScalingStatus:
    """A role's status after a decision: rewritten when its count or reason change
    (messages carry live numbers: rewriting them every round would be a write per
    round)."""
    if (
        previous is not None
        and decision.direction == "none"
        and (previous.replicas, previous.reason) == (decision.desired, decision.reason)
    ):
        return previous
    last = when(now) if decision.direction != "none" else None
    return api.RoleScalingStatus(
        replicas=decision.desired,
        reason=decision.reason,
        message=decision.message[:1024],
        last_scale_time=last or (previous.last_scale_time if previous else None),
    )


def decide(
    spec: api.ServingPoolSpec,
    signals: PoolSignals,
    replicas: Mapping[api.Role, planner.Replicas],
    previous: api.AutoscalingStatus | None,
    memory: planner.Memory,
    now: float,
) -> Outcome:
    """The planner's decisions for the pool, recorded in its autoscaling status."""
    settings = planner.Settings.of(spec)
    decisions, memory = planner.plan(settings, signals.observation, replicas, memory, now)
    previous = previous or api.AutoscalingStatus()
    updated: dict[str, api.RoleScalingStatus] = {
        role: role_status(previous.role(role), d, now) for role, d in decisions.items()
    }
    autoscaling = previous.model_copy(update=updated)
    if any(d.direction != "none" for d in decisions.values()):
        recorded = {"last_decision_time": when(now), "inputs": signals.observation.inputs()}
        autoscaling = autoscaling.model_copy(update=recorded)
    return Outcome(decisions, autoscaling, memory)


def change_text(decision: planner.Decision) -> str:
    """ "decode 1 -> 2: ITLAboveTarget: ITL p95 0.08 over 0.05" for Events and logs."""
    change = f"{decision.role} {decision.current} -> {decision.desired}"
    return f"{change}: {decision.reason}: {decision.message}"
