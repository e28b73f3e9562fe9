"""A rollout's metrics, the same for the operator and the local pool: each decision
(but the rounds that wait), the revisions' traffic weights and the step in force."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.operator.api import RoleRolloutStatus
from pdserve.protocol.routing import Role


class RolloutMetrics:
    """The rollout metrics of one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = reg = registry or CollectorRegistry()
        self.decisions = Counter(
            "pdserve_rollout_decisions_total",
            "Rollout decisions, by role, action (wait, promote, complete, rollback, abort) "
            "and reason (the condition that fired, or why).",
            ("pool", "role", "action", "reason"), registry=reg,
        )  # fmt: skip
        self.weight = Gauge(
            "pdserve_rollout_weight",
            "Percent of a role's requests each revision takes.",
            ("pool", "role", "revision"), registry=reg,
        )  # fmt: skip
        self.step = Gauge(
            "pdserve_rollout_step",
            "The step of a role's rollout in force (0-based; -1: none under way).",
            ("pool", "role"), registry=reg,
        )  # fmt: skip

    def record(self, pool: str, role: Role, status: RoleRolloutStatus, decided: bool) -> None:
        """A round's status; `decided`: its last decision is new (counted)."""
        decision = status.last_decision
        if decided and decision is not None:
            labels = {"pool": pool, "role": role}
            self.decisions.labels(**labels, action=decision.action, reason=decision.reason).inc()
        active = status.phase in ("Progressing", "Paused")
        self.step.labels(pool=pool, role=role).set(status.step if active else -1)
        canary = status.canary_revision
        weight = status.weight if active else 0
        self.weight.labels(pool=pool, role=role, revision=status.stable_revision).set(100 - weight)
        if canary is not None and canary != status.stable_revision:
            self.weight.labels(pool=pool, role=role, revision=canary).set(weight)

    def forget(self, pool: str, role: Role, revision: str) -> None:
        """A revision whose workers are gone takes no traffic: its weight goes."""
        with contextlib.suppress(KeyError):
            self.weight.remove(pool, role, revision)
