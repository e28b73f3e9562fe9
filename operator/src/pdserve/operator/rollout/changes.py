"""When a role's revision changes: start, restart or end its rollout (pure).

Each reconcile compares what a canary role's workers should run (its revision, from
the spec) with its rollout status and returns the status to render from:

- no status yet (a new pool, or a role switched from replace): the spec's revision
  is the role's stable revision, rendered at once (nothing to compare it with);
- a new revision while none is in progress: a rollout starts (`decision.start`),
  the canary beside the stable revision at the first step;
- a newer revision during a rollout: the canary is replaced by the newer one and the
  rollout starts again from the first step (the stable revision keeps serving; the
  old canary's figures say nothing about the new one);
- the spec back at the stable revision during a rollout: the rollout ends, Aborted
  (reason `Reverted`), and the canary goes;
- after a rollback or an abort, the spec still at the refused revision: nothing
  starts (it would be refused again); any other change starts a new rollout.

A role with the replace strategy has no rollout status.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from pdserve.operator import api
from pdserve.operator.rollout import decision

ENDED_BY_REFUSAL: frozenset[api.RolloutPhase] = frozenset({"RolledBack", "Aborted"})
# The pool's phase for `kubectl get`: the most pressing of its roles'.
PRESSING: tuple[api.RolloutPhase, ...] = (
    "Progressing", "Paused", "RolledBack", "Aborted", "Completed",
)  # fmt: skip


def adopted(revision: str) -> api.RoleRolloutStatus:
    """A role whose workers all run `revision`, with no rollout behind it."""
    return api.RoleRolloutStatus(phase="Completed", stable_revision=revision, weight=0)


def role_change(
    strategy: api.RolloutStrategy,
    status: api.RoleRolloutStatus | None,
    revision: str,
    now: datetime,
) -> api.RoleRolloutStatus:
    """A canary role's rollout status once the spec asks for `revision` (see the
    module's doc); `status` itself when nothing changes."""
    if status is None:
        return adopted(revision)
    if revision in (status.stable_revision, status.canary_revision):
        if revision == status.stable_revision and status.phase in decision.ACTIVE:
            return _reverted(status, now)
        return status
    if status.phase in ENDED_BY_REFUSAL and revision == status.canary_revision:
        return status
    started = decision.start(status.stable_revision, revision, strategy, now)
    if status.phase in decision.ACTIVE and status.canary_revision is not None:
        assert started.last_decision is not None
        message = f"{started.last_decision.message} (replaces canary {status.canary_revision})"
        note = started.last_decision.model_copy(update={"message": message[:1024]})
        started = started.model_copy(update={"last_decision": note})
    return started


def _reverted(status: api.RoleRolloutStatus, now: datetime) -> api.RoleRolloutStatus:
    message = (
        f"the spec is back at {status.stable_revision}: canary {status.canary_revision} removed"
    )
    note = api.RolloutDecision(action="abort", reason="Reverted", message=message, time=now)
    return status.model_copy(update={"phase": "Aborted", "weight": 0, "last_decision": note})


def pool_change(
    spec: api.ServingPoolSpec,
    rollout: api.RolloutStatus | None,
    revisions: Mapping[api.Role, str],
    now: datetime,
) -> api.RolloutStatus | None:
    """The pool's rollout status for a spec whose canary roles run `revisions` (the
    roles missing there, replace or absent, have none); None when no role has one."""
    roles: dict[str, api.RoleRolloutStatus | None] = {}
    for role in api.ROLES:
        workers = spec.pool(role)
        previous = rollout.role(role) if rollout is not None else None
        if workers is None or role not in revisions:
            roles[role] = None
        else:
            roles[role] = role_change(workers.rollout, previous, revisions[role], now)
    if all(status is None for status in roles.values()):
        return None
    return with_phase(api.RolloutStatus.model_validate(roles))


def with_phase(rollout: api.RolloutStatus) -> api.RolloutStatus:
    """The rollout status with the pool's phase: the most pressing of the roles' that
    have had a rollout (None while none has)."""
    phases = [
        status.phase
        for role in api.ROLES
        if (status := rollout.role(role)) is not None and status.last_decision is not None
    ]
    phase = min(phases, key=PRESSING.index) if phases else None
    return rollout.model_copy(update={"phase": phase})


def in_progress(rollout: api.RolloutStatus | None) -> list[api.Role]:
    """The roles whose rollout is in progress."""
    if rollout is None:
        return []
    return [
        role
        for role in api.ROLES
        if (status := rollout.role(role)) is not None and status.phase in decision.ACTIVE
    ]
