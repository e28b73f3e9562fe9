"""A rollout's metrics, one definition for the operator and the local pool: each
decision (but the rounds that wait; a start counts), the revisions' traffic weights and
the step in force. `pool_namespace` is the pool's namespace (empty for a local pool;
`namespace` would clash with the label Prometheus gives the operator's own target)."""

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
            "Rollout decisions other than waiting, by pool, role, action (promote, "
            "complete, rollback, abort; wait for a rollout's start) and reason (the "
            "rollback condition that fired, or why).",
            ("pool_namespace", "pool", "role", "action", "reason"), registry=reg,
        )  # fmt: skip
        self.weight = Gauge(
            "pdserve_rollout_weight",
            "Percent of a role's requests each of its revisions takes (the stable "
            "revision 100 once no rollout is in progress).",
            ("pool_namespace", "pool", "role", "revision"), registry=reg,
        )  # fmt: skip
        self.step = Gauge(
            "pdserve_rollout_step",
            "The step a role's rollout is at, from 1 (0: no rollout in progress).",
            ("pool_namespace", "pool", "role"), registry=reg,
        )  # fmt: skip

    def record(
        self, pool: str, role: Role, status: RoleRolloutStatus, decided: bool, namespace: str = ""
    ) -> None:
        """A round's status; `decided`: its last decision is new (counted)."""
        decision = status.last_decision
        labels = {"pool_namespace": namespace, "pool": pool, "role": role}
        if decided and decision is not None:
            self.decisions.labels(**labels, action=decision.action, reason=decision.reason).inc()
        active = status.phase in ("Progressing", "Paused")
        self.step.labels(**labels).set(status.step + 1 if active else 0)
        canary = status.canary_revision
        weight = status.weight if active else 0
        self.weight.labels(**labels, revision=status.stable_revision).set(100 - weight)
        if canary is not None and canary != status.stable_revision:
            self.weight.labels(**labels, revision=canary).set(weight)

    def forget(self, pool: str, role: Role, revision: str, namespace: str = "") -> None:
        """A revision whose workers are gone takes no traffic: its weight goes."""
        with contextlib.suppress(KeyError):
            self.weight.remove(namespace, pool, role, revision)
