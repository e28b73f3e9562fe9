"""A rollout's metrics, one definition for the operator and the local pool: each
decision (but the rounds that wait; a start counts), the revisions' traffic weights and
the step in force. `pool_namespace` is the pool's namespace (empty for a local pool;
`namespace` would clash with the label Prometheus gives the operator's own target)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.operator.api import RoleRolloutStatus
from pdserve.operator.rollout.decision import ACTIVE
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
        # The revisions each role has a weight series for (to remove those gone).
        self._revisions: dict[tuple[str, str, str], set[str]] = {}

    def record(
        self, pool: str, role: Role, status: RoleRolloutStatus, decided: bool, namespace: str = ""
    ) -> None:
        """A round's status; `decided`: its last decision is new (counted)."""
        decision = status.last_decision
        if decided and decision is not None:
            labels = {"pool_namespace": namespace, "pool": pool, "role": role}
            self.decisions.labels(**labels, action=decision.action, reason=decision.reason).inc()
        self.observe(pool, role, status, namespace)

    def observe(
        self, pool: str, role: Role, status: RoleRolloutStatus | None, namespace: str = ""
    ) -> None:
        """The weight and step gauges of a role from its rollout status: the stable and
        the canary revision's shares while it is in progress, the stable revision's 100
        once it has ended; none (series removed) without a status."""
        key = (namespace, pool, role)
        weights: dict[str, int] = {}
        active = status is not None and status.phase in ACTIVE
        if status is not None and active:
            weights[status.stable_revision] = 100 - status.weight
            if status.canary_revision is not None:
                weights[status.canary_revision] = status.weight
        elif status is not None:
            weights[status.stable_revision] = 100
        for gone in self._revisions.get(key, set()) - set(weights):
            with contextlib.suppress(KeyError):
                self.weight.remove(*key, gone)
        for revision, weight in weights.items():
            self.weight.labels(*key, revision).set(weight)
        self._revisions[key] = set(weights)
        if status is None:
            self._revisions.pop(key, None)
            with contextlib.suppress(KeyError):
                self.step.remove(*key)
        else:
            self.step.labels(*key).set(status.step + 1 if active else 0)
