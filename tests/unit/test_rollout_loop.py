"""The operator's rollout rounds (pure parts): manual commands acted on once, a
round's decisions on its analysis, the Events' words and the rollout gauges."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from pdserve.operator import api, metrics
from pdserve.operator.rollout import decision, events, manual
from pdserve.operator.rollout.loop import next_status
from support.pools import example, merged

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STEPS = [{"weight": 10, "analysisSeconds": 60}, {"weight": 50, "analysisSeconds": 60}]


def spec() -> api.ServingPoolSpec:
    patch = {"spec": {"decode": {"replicas": 4, "rollout": {"type": "canary", "steps": STEPS}}}}
    return api.parse_pool(merged(example("tiny-colocated"), patch)).spec


def started() -> api.RolloutStatus:
    workers = spec().decode
    role = decision.start("decode-aaaaaaaaaa", "decode-bbbbbbbbbb", workers.rollout, T0)
    return api.RolloutStatus(phase="Progressing", decode=role)


def figures(requests: float, itl: float) -> api.RevisionFigures:
    return api.RevisionFigures(requests=requests, itl_p99_seconds=itl)


def evidence(canary: str = "decode-bbbbbbbbbb", step: int = 0) -> Any:
    analysis = decision.Analysis(canary=figures(50, 0.02), baseline=figures(400, 0.02))
    return {"decode": (canary, step, analysis)}


# --- manual commands --------------------------------------------------------------------


def test_a_command_acts_once_per_change_of_its_value() -> None:
    fresh = manual.pending({manual.ANNOTATION: "promote"})
    assert (fresh.command, fresh.record, fresh.changed) == ("promote", "promote", True)
    done = {manual.ANNOTATION: "promote", manual.ACTED_ANNOTATION: "promote"}
    assert manual.pending(done).command is None and not manual.pending(done).changed
    # The operator's own record counts before the pool shows it.
    assert manual.pending({manual.ANNOTATION: "promote"}, acted="promote").command is None
    # Removed: the record goes, so the same command set again acts again.
    gone = manual.pending({manual.ACTED_ANNOTATION: "promote"})
    assert (gone.command, gone.record, gone.changed) == (None, None, True)
    other = manual.pending({manual.ANNOTATION: "abort", manual.ACTED_ANNOTATION: "promote"})
    assert other.command == "abort"


def test_an_unknown_command_is_recorded_and_named() -> None:
    wanted = manual.pending({manual.ANNOTATION: "rollback-now"})
    assert wanted.command is None and wanted.invalid == "rollback-now" and wanted.changed


# --- rounds -----------------------------------------------------------------------------


def test_no_analysis_waits_past_the_window_and_never_promotes() -> None:
    later = T0 + timedelta(hours=1)
    after = next_status(spec(), started(), {}, None, later)
    assert after is not None and after.decode is not None
    assert after.decode.step == 0 and after.decode.phase == "Progressing"
    assert after.decode.last_decision is not None
    assert after.decode.last_decision.reason == "TooFewRequests"
    # The same wait next round writes nothing.
    assert next_status(spec(), after, {}, None, later + timedelta(seconds=10)) == after


def test_evidence_after_the_window_promotes_and_a_wait_keeps_the_promotion() -> None:
    promoted = next_status(spec(), started(), evidence(), None, T0 + timedelta(seconds=61))
    assert promoted is not None and promoted.decode is not None
    assert (promoted.decode.step, promoted.decode.weight) == (1, 50)
    assert promoted.decode.last_decision is not None
    assert promoted.decode.last_decision.reason == "AnalysisPassed"
    # The analysis made for step 1 is not taken for step 2; the promotion stays on record.
    waited = next_status(spec(), promoted, evidence(), None, T0 + timedelta(seconds=62))
    assert waited == promoted


def test_an_analysis_of_another_canary_is_not_used() -> None:
    stale = evidence(canary="decode-cccccccccc")
    after = next_status(spec(), started(), stale, None, T0 + timedelta(seconds=61))
    assert after is not None and after.decode is not None and after.decode.step == 0


def test_an_abort_ends_the_rollout_at_once() -> None:
    aborted = next_status(spec(), started(), {}, "abort", T0 + timedelta(seconds=1))
    assert aborted is not None and aborted.decode is not None
    assert (aborted.phase, aborted.decode.phase, aborted.decode.weight) == ("Aborted", "Aborted", 0)


# --- what is said about it --------------------------------------------------------------


class Recorded:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def normal(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        self.posted.append(("Normal", reason, message))

    def warning(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        self.posted.append(("Warning", reason, message))


def test_a_rollback_is_a_warning_with_its_figures_and_counted() -> None:
    breach = decision.Breach(
        condition="itlOverTarget", bucket="le512", canary=figures(80, 0.3),
        baseline=figures(700, 0.04), message="ITL p99 0.3s over the 0.1s target for 60s",
    )  # fmt: skip
    analysis = decision.Analysis(
        canary=figures(80, 0.3), baseline=figures(700, 0.04), breaches=(breach,)
    )
    before = started()
    after = next_status(spec(), before, {"decode": ("decode-bbbbbbbbbb", 0, analysis)}, None, T0)
    recorder = Recorded()
    pool = {"metadata": {"namespace": "ns", "name": "events-pool"}}
    labels = {"pool_namespace": "ns", "pool": "events-pool", "role": "decode"}
    counted = {**labels, "action": "rollback", "reason": "itlOverTarget"}
    assert metrics.ROLLOUT.decisions.labels(**counted)._value.get() == 0
    events.announce(recorder, pool, before, after)
    ((kind, reason, message),) = recorder.posted
    assert (kind, reason) == ("Warning", "itlOverTarget")
    assert "decode: rollback: ITL p99 0.3s" in message and "(bucket le512)" in message
    assert "canary: 80 requests, itlP99Seconds 0.3" in message
    assert "stable: 700 requests, itlP99Seconds 0.04" in message
    assert metrics.ROLLOUT.decisions.labels(**counted)._value.get() == 1
    # Rolled back: the stable revision takes every request, no step is in force.
    stable = {**labels, "revision": "decode-aaaaaaaaaa"}
    assert metrics.ROLLOUT.weight.labels(**stable)._value.get() == 100
    assert metrics.ROLLOUT.step.labels(**labels)._value.get() == 0
    events.announce(recorder, pool, after, after)  # no new decision: nothing said
    assert len(recorder.posted) == 1
    events.forget("ns", "events-pool")
    names = {s.labels.get("pool") for m in metrics.ROLLOUT.weight.collect() for s in m.samples}
    assert "events-pool" not in names
