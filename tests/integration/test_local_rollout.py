"""Guarded rollouts of a local pool under steady load, its manifest edited while it
runs, judged on a real Prometheus scraping its router and workers.

A bad change is bad by construction: every decode worker carries a fault that stalls
each engine step by SLOW_STEP_S when the worker's token budget is over the stable
one's, so raising `maxNumBatchedTokens` breaks the ITL target on the canary alone,
however fast the machine. It is rolled back within its step's analysis window, with
no failed request; a harmless change goes through every step to completion."""

from __future__ import annotations

import time
from pathlib import Path

from pdserve.operator.local.pool import role_revision
from pdserve.operator.local.rollout import ANNOTATION
from support.prom import total
from support.rollouts import (
    ITL_TARGET_S,
    QUIET,
    SHORT,
    SLOW_WHEN_BUDGET_RAISED,
    STABLE_BUDGET,
    decisions,
    decode_rollout,
    rolling_pool,
    rollout_pool,
    write_manifest,
)
from support.scaling import Load
from support.waiting import wait_until


def test_a_budget_that_breaks_the_itl_target_is_rolled_back_without_a_failed_request(
    small_model_dir: Path, tmp_path: Path
) -> None:
    window_s = 120
    rollout = {
        "type": "canary", "steps": [{"weight": 50, "analysisSeconds": window_s}],
        "minRequests": 3, "conditions": QUIET,
    }  # fmt: skip
    pool = rollout_pool("bad", small_model_dir, rollout)
    bad = rollout_pool("bad", small_model_dir, rollout, maxNumBatchedTokens=4 * STABLE_BUDGET)
    with rolling_pool(pool, tmp_path, SLOW_WHEN_BUDGET_RAISED) as (local, _, manifest):
        stable = local.stable["decode"]
        canary = role_revision(bad, "decode")
        with Load(local.url, 4, SHORT, 4, vary=True) as load:
            wait_until(lambda: load.outcomes.ok >= 4, 120, "the stable revision serving")
            write_manifest(manifest, bad)
            changed = time.monotonic()
            wait_until(lambda: local.of_revision("decode", canary), 120, "the canary's worker")
            ended = wait_until(
                lambda: (r := decode_rollout(local)) is not None and r.phase == "RolledBack" and r,
                240, "the canary rolled back",
            )  # fmt: skip
            wait_until(lambda: not local.of_revision("decode", canary), 120, "the canary gone")
            rolled_back_s = time.monotonic() - changed
            served_by_canary = total(
                f"{local.url}/metrics", "pdserve_router_requests_total", decode_revision=canary
            )
            ok_after = load.outcomes.ok
            wait_until(lambda: load.outcomes.ok >= ok_after + 4, 120, "the stable one serving on")
    decision = ended.last_decision
    assert decision is not None and decision.action == "rollback"
    assert decision.reason == "itlOverTarget"
    assert decision.canary is not None and decision.canary.itl_p99_seconds is not None
    assert decision.canary.itl_p99_seconds > ITL_TARGET_S
    assert "P99 ITL" in decision.message
    # Both revisions' figures, from the router's and the workers' metrics by revision.
    assert decision.baseline is not None and decision.baseline.requests > 0
    for figures in (decision.canary, decision.baseline):
        assert figures.kv_cache_usage is not None and figures.ttft_p95_seconds is not None
        # Goodput and error rate are shares of the requests the revision finished in the
        # window: none before its first (the canary's streams' gaps can breach the target
        # before any of its requests ends, and the rollback does not wait for one).
        if figures.requests > 0:
            assert figures.goodput is not None and figures.error_rate == 0
        else:
            assert figures.goodput is None and figures.error_rate is None
    assert ended.step_started_time is not None
    assert (decision.time - ended.step_started_time).total_seconds() < window_s
    assert ended.stable_revision == stable and ended.weight == 0
    assert local.stable["decode"] == stable and local.weights["decode"] == ()
    assert [local.revision_of(w) for w in local.workers["decode"]] == [stable]
    assert served_by_canary > 0
    assert load.outcomes.failed == []
    print(
        f"rolled back {rolled_back_s:.1f}s after the change; canary served {served_by_canary:.0f}"
    )


def test_a_harmless_change_is_promoted_through_every_step_to_completion(
    small_model_dir: Path, tmp_path: Path
) -> None:
    rollout = {
        "type": "canary",
        "steps": [{"weight": 30, "analysisSeconds": 4}, {"weight": 60, "analysisSeconds": 4}],
        "minRequests": 2, "conditions": QUIET,
    }  # fmt: skip
    pool = rollout_pool("harmless", small_model_dir, rollout)
    harmless = rollout_pool("harmless", small_model_dir, rollout, maxNumSeqs=12)
    with rolling_pool(pool, tmp_path, SLOW_WHEN_BUDGET_RAISED) as (local, rollouts, manifest):
        old = local.stable["decode"]
        new = role_revision(harmless, "decode")
        with Load(local.url, 4, SHORT, 4, vary=True) as load:
            wait_until(lambda: load.outcomes.ok >= 4, 120, "the stable revision serving")
            manifest.write_text("spec: [this is not a ServingPool")
            time.sleep(2)  # a round or more: the bad edit refused, nothing changed
            assert decode_rollout(local) is None and local.stable["decode"] == old
            write_manifest(manifest, harmless)
            started = time.monotonic()
            ended = wait_until(
                lambda: (r := decode_rollout(local)) is not None and r.phase == "Completed" and r,
                300, "the rollout completed",
            )  # fmt: skip
            wait_until(lambda: not local.of_revision("decode", old), 120, "the old revision gone")
            completed_s = time.monotonic() - started
    assert ended.stable_revision == new and ended.canary_revision is None
    assert decisions(rollouts, "promote", "AnalysisPassed") == 1
    assert decisions(rollouts, "complete", "AnalysisPassed") == 1
    assert local.stable["decode"] == new and local.weights["decode"] == ()
    assert [local.revision_of(w) for w in local.workers["decode"]] == [new]
    assert load.outcomes.failed == [] and load.outcomes.ok > 0
    print(f"completed {completed_s:.1f}s after the change")


def test_an_abort_by_annotation_restores_the_stable_revision_and_replace_swaps_every_worker(
    small_model_dir: Path, tmp_path: Path
) -> None:
    canary_rollout = {"type": "canary", "steps": [{"weight": 50, "analysisSeconds": 600}]}
    pool = rollout_pool("manual", small_model_dir, canary_rollout)
    changed = rollout_pool("manual", small_model_dir, canary_rollout, maxNumSeqs=12)
    with rolling_pool(pool, tmp_path) as (local, rollouts, manifest):
        old, new = local.stable["decode"], role_revision(changed, "decode")
        with Load(local.url, 2, SHORT, 2, vary=True) as load:
            write_manifest(manifest, changed)
            wait_until(lambda: local.of_revision("decode", new), 120, "the canary's worker")
            aborted = changed.model_copy(deep=True)
            aborted.metadata.annotations[ANNOTATION] = "abort"
            write_manifest(manifest, aborted)
            ended = wait_until(
                lambda: (r := decode_rollout(local)) is not None and r.phase == "Aborted" and r,
                120, "the rollout aborted",
            )  # fmt: skip
            wait_until(lambda: not local.of_revision("decode", new), 120, "the canary gone")
            assert local.stable["decode"] == old
            replaced = rollout_pool("manual", small_model_dir, {"type": "replace"}, maxNumSeqs=12)
            write_manifest(manifest, replaced)
            wait_until(
                lambda: [local.revision_of(w) for w in local.workers["decode"]] == [new], 120,
                "every decode worker replaced",
            )  # fmt: skip
    decision = ended.last_decision
    assert decision is not None and (decision.action, decision.reason) == ("abort", "ManualAbort")
    assert decisions(rollouts, "abort", "ManualAbort") == 1
    assert local.stable["decode"] == new and local.weights["decode"] == ()
    assert load.outcomes.failed == [] and load.outcomes.ok > 0
