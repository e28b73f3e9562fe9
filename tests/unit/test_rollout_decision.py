"""A rollout's decision: rolled back as soon as a condition fires, promoted only on
evidence after each step's window, completed after the last step, and ended for good."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pdserve.operator.api import RevisionFigures, RolloutStep, RolloutStrategy
from pdserve.operator.rollout.decision import (
    Analysis,
    Breach,
    canary_workers,
    decide,
    stable_workers,
    start,
)
from pdserve.operator.rollout.revision import revision_name

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STRATEGY = RolloutStrategy(
    type="canary",
    steps=(
        RolloutStep(weight=10, analysis_seconds=60),
        RolloutStep(weight=50, analysis_seconds=60),
    ),
    min_requests=20,
)


def served(canary: float, baseline: float) -> Analysis:
    return Analysis(RevisionFigures(requests=canary), RevisionFigures(requests=baseline))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_fired_condition_rolls_back_at_once_with_its_figures() -> None:
    status = start("decode-a", "decode-b", STRATEGY, T0)
    breach = Breach(
        "itlOverTarget",
        "le512",
        RevisionFigures(requests=5, itl_p99_seconds=0.4),
        RevisionFigures(requests=40, itl_p99_seconds=0.05),
        "P99 ITL 400 ms over the 200 ms target",
    )
    after = decide(STRATEGY, status, Analysis(breach.canary, breach.baseline, (breach,)), at(5))
    assert (after.phase, after.weight, after.stable_revision) == ("RolledBack", 0, "decode-a")
    assert after.last_decision is not None
    assert after.last_decision.reason == "itlOverTarget"
    assert after.last_decision.bucket == "le512"
    assert after.last_decision.canary == breach.canary
    assert decide(STRATEGY, after, served(100, 100), at(500), "promote") == after


def test_promotion_waits_for_the_window_and_for_evidence_then_completes() -> None:
    status = start("decode-a", "decode-b", STRATEGY, T0)
    assert decide(STRATEGY, status, served(100, 100), at(30)).weight == 10
    waiting = decide(STRATEGY, status, served(3, 100), at(61))
    assert waiting.step == 0 and waiting.last_decision is not None
    assert waiting.last_decision.reason == "TooFewRequests"
    second = decide(STRATEGY, waiting, served(25, 100), at(62))
    assert (second.step, second.weight, second.phase) == (1, 50, "Progressing")
    assert decide(STRATEGY, second, served(25, 100), at(100)).step == 1
    done = decide(STRATEGY, second, served(25, 100), at(123))
    assert (done.phase, done.stable_revision, done.canary_revision) == (
        "Completed",
        "decode-b",
        None,
    )
    assert done.weight == 100


def test_manual_commands() -> None:
    status = start("decode-a", "decode-b", STRATEGY, T0)
    promoted = decide(STRATEGY, status, None, at(1), "promote")
    assert promoted.step == 1
    aborted = decide(STRATEGY, promoted, served(100, 100), at(2), "abort")
    assert (aborted.phase, aborted.weight, aborted.stable_revision) == ("Aborted", 0, "decode-a")


def test_worker_split_keeps_the_stable_revision_serving() -> None:
    status = start("decode-a", "decode-b", STRATEGY, T0)
    assert (canary_workers(STRATEGY, status, 1), stable_workers(STRATEGY, status, 1)) == (1, 1)
    assert (canary_workers(STRATEGY, status, 20), stable_workers(STRATEGY, status, 20)) == (2, 18)
    ended = decide(STRATEGY, status, None, at(1), "abort")
    assert (canary_workers(STRATEGY, ended, 4), stable_workers(STRATEGY, ended, 4)) == (0, 4)


def test_revision_names_change_with_content_not_key_order() -> None:
    first = revision_name("decode", {"args": ["--max-num-batched-tokens", "512"], "image": "x"})
    same = revision_name("decode", {"image": "x", "args": ["--max-num-batched-tokens", "512"]})
    other = revision_name("decode", {"image": "x", "args": ["--max-num-batched-tokens", "64"]})
    assert first == same != other
    assert first.startswith("decode-") and len(first) <= 63
