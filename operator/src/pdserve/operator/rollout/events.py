"""What the operator says about a rollout's decisions: a Kubernetes Event per
decision other than waiting (and per start), its reason the decision's and its
message the figures it was made on, and the rollout metrics (operator's /metrics)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pdserve.operator import api, metrics

REFUSALS: frozenset[api.RolloutAction] = frozenset({"rollback", "abort"})


class Recorder(Protocol):
    """Posts Kubernetes Events about a pool."""

    def normal(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        """An Event of type Normal."""

    def warning(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        """An Event of type Warning."""


def figures(revision: api.RevisionFigures) -> str:
    """ "120 requests, itlP99Seconds 0.082, ..." for the figures a revision has."""
    known = api.dump(revision)
    parts = [f"{known.pop('requests', 0):.0f} requests"]
    parts += [f"{name} {value:.4g}" for name, value in known.items()]
    return ", ".join(parts)


def describe(role: api.Role, decision: api.RolloutDecision) -> str:
    """A decision as an Event's message: what, why, and on which figures."""
    text = f"{role}: {decision.action}: {decision.message}"
    if decision.bucket is not None:
        text += f" (bucket {decision.bucket})"
    if decision.canary is not None:
        text += f"; canary: {figures(decision.canary)}"
    if decision.baseline is not None:
        text += f"; stable: {figures(decision.baseline)}"
    return text


def announce(
    recorder: Recorder,
    pool: Mapping[str, Any],
    old: api.RolloutStatus | None,
    new: api.RolloutStatus | None,
) -> None:
    """An Event and a count for every role whose last decision is new and not a wait
    (a start counts); the gauges set to the new status."""
    meta = pool["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    for role in api.ROLES:
        before = old.role(role) if old is not None else None
        after = new.role(role) if new is not None else None
        decision = after.last_decision if after is not None else None
        if decision is None or (before is not None and before.last_decision == decision):
            continue
        if decision.action == "wait" and decision.reason != "Started":
            continue
        metrics.ROLLOUT.decisions.labels(
            pool_namespace=namespace, pool=name, role=role, action=decision.action,
            reason=decision.reason,
        ).inc()  # fmt: skip
        post = recorder.warning if decision.action in REFUSALS else recorder.normal
        post(pool, decision.reason, describe(role, decision))
    observe(namespace, name, new)


def observe(namespace: str, pool: str, rollout: api.RolloutStatus | None) -> None:
    """Set the weight and step gauges of a pool's roles from its rollout status."""
    for role in api.ROLES:
        status = rollout.role(role) if rollout is not None else None
        metrics.ROLLOUT.observe(pool, role, status, namespace)


def forget(namespace: str, pool: str) -> None:
    """Remove a deleted pool's rollout gauges."""
    observe(namespace, pool, None)
