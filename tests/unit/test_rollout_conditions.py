"""The rollback conditions judged on figures: each fires on the canary's figures past
its threshold or its ratio to the stable revision's, and never on missing figures."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pdserve.operator.api import RevisionFigures, RoleRolloutStatus, RollbackConditions
from pdserve.operator.rollout.analysis import _range, _window_seconds
from pdserve.operator.rollout.conditions import judge
from pdserve.protocol.routing import Slo

SLO = Slo(ttft_seconds=2.0, itl_seconds=0.1)
DEFAULTS = RollbackConditions()


def figures(**values: float) -> RevisionFigures:
    return RevisionFigures(requests=50, **values)


def conditions(**patch: object) -> RollbackConditions:
    return RollbackConditions.model_validate(patch)


def test_itl_over_target_fires_on_the_canary_past_the_target_times_threshold() -> None:
    over = judge("itlOverTarget", DEFAULTS, SLO, "le64", True, figures(itl_p99_seconds=0.15),
                 figures(itl_p99_seconds=0.02))  # fmt: skip
    assert over is not None and over.condition == "itlOverTarget" and over.bucket == "le64"
    assert "150ms over 100ms" in over.message
    under = judge("itlOverTarget", DEFAULTS, SLO, "le64", True, figures(itl_p99_seconds=0.09),
                  figures())  # fmt: skip
    assert under is None
    lenient = conditions(itlOverTarget={"threshold": 2.0})
    assert judge("itlOverTarget", lenient, SLO, "all", True, figures(itl_p99_seconds=0.15),
                 figures()) is None  # fmt: skip


def test_itl_over_target_needs_a_target_and_a_figure() -> None:
    assert judge("itlOverTarget", DEFAULTS, Slo(), "all", True, figures(itl_p99_seconds=9.0),
                 figures()) is None  # fmt: skip
    assert judge("itlOverTarget", DEFAULTS, SLO, "all", True, figures(), figures()) is None


def test_itl_over_target_with_a_baseline_ratio_spares_a_canary_as_slow_as_stable() -> None:
    rule = conditions(itlOverTarget={"baselineRatio": 1.5})
    same = figures(itl_p99_seconds=0.2)
    assert judge("itlOverTarget", rule, SLO, "all", True, same, same) is None
    assert judge("itlOverTarget", rule, SLO, "all", True, figures(itl_p99_seconds=0.4),
                 same) is not None  # fmt: skip


def test_preemptions_fire_only_together_with_a_slower_ttft() -> None:
    stable = figures(preemption_rate=0.1, ttft_p95_seconds=1.0)
    both = figures(preemption_rate=0.3, ttft_p95_seconds=2.0)
    fired = judge("preemptionsWithTtft", DEFAULTS, SLO, "all", True, both, stable)
    assert fired is not None and "preemptions 0.3" in fired.message
    only_preemptions = figures(preemption_rate=0.3, ttft_p95_seconds=1.1)
    assert judge("preemptionsWithTtft", DEFAULTS, SLO, "all", True, only_preemptions,
                 stable) is None  # fmt: skip
    none_preempted = figures(preemption_rate=0.0, ttft_p95_seconds=5.0)
    assert judge("preemptionsWithTtft", DEFAULTS, SLO, "all", True, none_preempted,
                 figures(preemption_rate=0.0, ttft_p95_seconds=1.0)) is None  # fmt: skip


def test_short_requests_slowed_is_judged_in_the_first_bucket_only() -> None:
    canary, stable = figures(short_e2e_p95_seconds=2.0), figures(short_e2e_p95_seconds=1.0)
    assert judge("shortRequestsSlowed", DEFAULTS, SLO, "le64", True, canary, stable) is not None
    assert judge("shortRequestsSlowed", DEFAULTS, SLO, "gt64", False, canary, stable) is None
    slightly = figures(short_e2e_p95_seconds=1.9)
    assert judge("shortRequestsSlowed", DEFAULTS, SLO, "le64", True, slightly, stable) is None


def test_utilisation_up_and_goodput_down_must_hold_together() -> None:
    stable = figures(kv_cache_usage=0.3, goodput=1.0)
    worse = figures(kv_cache_usage=0.6, goodput=0.5)
    fired = judge("utilisationUpGoodputDown", DEFAULTS, SLO, "all", True, worse, stable)
    assert fired is not None and "goodput 50%" in fired.message
    busier_but_good = figures(kv_cache_usage=0.6, goodput=0.95)
    assert judge("utilisationUpGoodputDown", DEFAULTS, SLO, "all", True, busier_but_good,
                 stable) is None  # fmt: skip
    idler = figures(kv_cache_usage=0.2, goodput=0.5)
    assert judge("utilisationUpGoodputDown", DEFAULTS, SLO, "all", True, idler, stable) is None


def test_error_rates_need_the_threshold_and_the_ratio() -> None:
    stable = figures(error_rate=0.0, cancel_rate=0.02, timeout_rate=0.0)
    errors = judge("errorRates", DEFAULTS, SLO, "all", True, figures(error_rate=0.05), stable)
    assert errors is not None and "error rate 5.0%" in errors.message
    under_floor = figures(error_rate=0.005)
    assert judge("errorRates", DEFAULTS, SLO, "all", True, under_floor, stable) is None
    cancels_like_stable = figures(cancel_rate=0.025)
    assert judge("errorRates", DEFAULTS, SLO, "all", True, cancels_like_stable, stable) is None
    timeouts = judge("errorRates", DEFAULTS, SLO, "all", True, figures(timeout_rate=0.1), stable)
    assert timeouts is not None and "timeout rate" in timeouts.message


def test_a_condition_looks_back_its_duration_clipped_to_the_window() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    status = RoleRolloutStatus(phase="Progressing", stable_revision="a", step_started_time=start)
    window = _window_seconds(status, start + timedelta(seconds=30))
    assert window == 30
    assert _range(DEFAULTS, "itlOverTarget", window) == 30  # 600 s, clipped
    assert _range(conditions(errorRates={"durationSeconds": 10}), "errorRates", window) == 10
    assert _range(conditions(errorRates={"durationSeconds": 0}), "errorRates", window) == 30
