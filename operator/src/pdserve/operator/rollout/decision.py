"""A rollout's decision: pure, the same for the operator and the local pool.

Each round, a role's rollout status, the strategy, the analysis of the current step's
window so far and any manual command go in; the next status comes out, its
`lastDecision` saying what was done and on which figures. The conditions are judged on
every round, so a canary that breaks one is rolled back as soon as the condition has
held for its duration, not at the end of its step; it is promoted only when its step's
window has passed and both revisions served enough requests to judge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from pdserve.operator.api import (
    RevisionFigures,
    RoleRolloutStatus,
    RollbackConditionName,
    RolloutAction,
    RolloutDecision,
    RolloutPhase,
    RolloutStrategy,
)

Manual = Literal["promote", "abort"]
ACTIVE: frozenset[RolloutPhase] = frozenset({"Progressing", "Paused"})


@dataclass(frozen=True)
class Breach:
    """A rollback condition that fired: in which bucket, on which figures."""

    condition: RollbackConditionName
    bucket: str
    canary: RevisionFigures
    baseline: RevisionFigures
    message: str


@dataclass(frozen=True)
class Analysis:
    """What the current step's window says so far: the requests each revision served,
    the conditions that fired (empty: none), and the figures over all buckets."""

    canary: RevisionFigures
    baseline: RevisionFigures
    breaches: tuple[Breach, ...] = field(default=())


def start(stable: str, canary: str, strategy: RolloutStrategy, now: datetime) -> RoleRolloutStatus:
    """A canary's first step, from a role whose workers run `stable`."""
    return RoleRolloutStatus(
        phase="Progressing",
        stable_revision=stable,
        canary_revision=canary,
        step=0,
        weight=strategy.steps[0].weight,
        step_started_time=now,
        last_decision=_decision(
            "wait", "Started", f"canary {canary} beside {stable}: step 1 of "
            f"{len(strategy.steps)}, {strategy.steps[0].weight}% of requests", now
        ),
    )  # fmt: skip


def decide(
    strategy: RolloutStrategy,
    status: RoleRolloutStatus,
    analysis: Analysis | None,
    now: datetime,
    manual: Manual | None = None,
) -> RoleRolloutStatus:
    """The next status of a role's rollout (unchanged once it has ended).

    An abort or a fired condition ends it with the stable revision restored; a manual
    promote moves to the next step at once; otherwise the step waits for its window
    and for evidence, then promotes, and the last step's promotion completes it.
    """
    if status.phase not in ACTIVE:
        return status
    if manual == "abort":
        return _end(
            status, "Aborted", _decision("abort", "ManualAbort", "aborted by annotation", now)
        )
    if analysis is not None and analysis.breaches:
        return _end(status, "RolledBack", _breach_decision(analysis.breaches[0], now))
    if manual == "promote":
        return _promote(strategy, status, analysis, now, "ManualPromote")
    if not _window_passed(strategy, status, now):
        return _wait(status, analysis, now, "Analysing", "the step's window has not passed")
    if analysis is None or not _enough(strategy, analysis):
        return _wait(status, analysis, now, "TooFewRequests", _evidence(strategy, analysis))
    return _promote(strategy, status, analysis, now, "AnalysisPassed")


def canary_workers(strategy: RolloutStrategy, status: RoleRolloutStatus, replicas: int) -> int:
    """Workers of the canary revision at the status's step: its share of `replicas`
    rounded up, at least one (none once the rollout has ended)."""
    if status.phase not in ACTIVE or status.canary_revision is None:
        return 0
    step = strategy.steps[min(status.step, len(strategy.steps) - 1)]
    percent = step.workers if step.workers is not None else step.weight
    return max(1, min(replicas, math.ceil(replicas * percent / 100)))


def stable_workers(strategy: RolloutStrategy, status: RoleRolloutStatus, replicas: int) -> int:
    """Workers of the stable revision: the rest of `replicas`, at least one while a
    canary runs (the stable revision keeps serving its share)."""
    canary = canary_workers(strategy, status, replicas)
    if canary == 0:
        return replicas
    return max(1, replicas - canary)


def _window_passed(strategy: RolloutStrategy, status: RoleRolloutStatus, now: datetime) -> bool:
    if status.step_started_time is None:
        return True
    step = strategy.steps[min(status.step, len(strategy.steps) - 1)]
    return (now - status.step_started_time).total_seconds() >= step.analysis_seconds


def _enough(strategy: RolloutStrategy, analysis: Analysis) -> bool:
    least = strategy.min_requests
    return analysis.canary.requests >= least and analysis.baseline.requests >= least


def _evidence(strategy: RolloutStrategy, analysis: Analysis | None) -> str:
    if analysis is None:
        return "no figures for the window yet"
    return (
        f"canary served {analysis.canary.requests:.0f} and stable "
        f"{analysis.baseline.requests:.0f} requests in the window; each needs "
        f"{strategy.min_requests}"
    )


def _promote(
    strategy: RolloutStrategy,
    status: RoleRolloutStatus,
    analysis: Analysis | None,
    now: datetime,
    reason: str,
) -> RoleRolloutStatus:
    following = status.step + 1
    canary = status.canary_revision or status.stable_revision
    if following >= len(strategy.steps):
        decision = _decision("complete", reason, f"{canary} takes every worker", now, analysis)
        return status.model_copy(
            update={
                "phase": "Completed",
                "stable_revision": canary,
                "canary_revision": None,
                "weight": 100,
                "step_started_time": now,
                "last_decision": decision,
            }
        )
    weight = strategy.steps[following].weight
    message = f"step {following + 1} of {len(strategy.steps)}: {weight}% of requests"
    return status.model_copy(
        update={
            "phase": "Progressing",
            "step": following,
            "weight": weight,
            "step_started_time": now,
            "last_decision": _decision("promote", reason, message, now, analysis),
        }
    )


def _wait(
    status: RoleRolloutStatus,
    analysis: Analysis | None,
    now: datetime,
    reason: str,
    message: str,
) -> RoleRolloutStatus:
    decision = _decision("wait", reason, message, now, analysis)
    return status.model_copy(update={"last_decision": decision})


def _end(
    status: RoleRolloutStatus, phase: RolloutPhase, decision: RolloutDecision
) -> RoleRolloutStatus:
    """The rollout ended with the stable revision restored: the canary takes nothing."""
    return status.model_copy(update={"phase": phase, "weight": 0, "last_decision": decision})


def _breach_decision(breach: Breach, now: datetime) -> RolloutDecision:
    return RolloutDecision(
        action="rollback",
        reason=breach.condition,
        message=breach.message[:1024],
        bucket=breach.bucket,
        canary=breach.canary,
        baseline=breach.baseline,
        time=now,
    )


def _decision(
    action: RolloutAction,
    reason: str,
    message: str,
    now: datetime,
    analysis: Analysis | None = None,
) -> RolloutDecision:
    return RolloutDecision(
        action=action,
        reason=reason,
        message=message[:1024],
        canary=analysis.canary if analysis is not None else None,
        baseline=analysis.baseline if analysis is not None else None,
        time=now,
    )
