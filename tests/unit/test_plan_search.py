"""The plan's candidates, its judgement of simulated figures, its choice and its
answer in words (figures made up; the simulator is tested in tests/integration and
the whole command in tests/e2e/test_plan.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.operator import api
from pdserve.operator.planning.candidates import Bounds, Candidate, Family, candidates
from pdserve.operator.planning.recommend import (
    PLAN_ANNOTATION,
    recommended,
    recommended_pool,
    table,
    verdict,
)
from pdserve.operator.planning.search import Target, Trial, judge

MANIFEST: dict[str, Any] = {
    "apiVersion": "pdserve.dev/v1alpha1",
    "kind": "ServingPool",
    "metadata": {"name": "chat"},
    "spec": {
        "model": {"name": "m", "path": "/models/m"},
        "slo": {"ttft": {"seconds": 1.0}, "itl": {"seconds": 0.1, "percentile": 99}},
        "autoscaling": {
            "prefill": {"minReplicas": 1, "maxReplicas": 2},
            "decode": {"minReplicas": 1, "maxReplicas": 3},
        },
    },
}
SPEC = api.parse_pool(MANIFEST).spec
TARGETS = (Target("TTFT", "ttft_s", 1.0, 95.0), Target("ITL", "itl_s", 0.1, 99.0))


def test_candidates_stay_within_the_bounds_and_the_ratio() -> None:
    spec = api.parse_spec({
        **MANIFEST["spec"],
        "autoscaling": {
            **MANIFEST["spec"]["autoscaling"],
            "policy": {"prefillDecodeRatio": {"max": 0.5}},
        },
    })  # fmt: skip
    bounds = Bounds.of(spec, max_workers=None)
    tried = [c for total in range(1, 6) for c in candidates(spec, bounds, total)]

    assert {c.family for c in tried} == {"colocated", "bucketed", "disaggregated"}
    assert all(1 <= c.decode <= 3 for c in tried)
    assert all(c.prefill <= 2 and c.prefill <= 0.5 * c.decode for c in tried)
    assert all((c.prefill > 0) == (c.spec.prefill is not None) for c in tried)
    colocated = [c for c in tried if c.family == "colocated"]
    assert {c.spec.decode.engine.token_budget.mode for c in colocated} == {"static", "adaptive"}
    bucketed = [c for c in tried if c.family == "bucketed"]
    assert all(c.spec.routing.buckets[0].max_input_tokens == c.boundary for c in bucketed)


def figures(ttft: float, itl: float) -> dict[str, Any]:
    return {"ttft_s": {"p95": ttft, "p50": ttft / 2}, "itl_s": {"p99": itl, "p50": itl / 2}}


def trial(
    family: Family, prefill: int, decode: int, short: tuple[float, float], long: tuple[float, float]
) -> Trial:
    """A made-up simulation: figures for short and long prompts, and over both."""
    worst = (max(short[0], long[0]), max(short[1], long[1]))
    buckets: list[dict[str, Any]] = (
        [{"mode": "colocated"}]
        if family == "colocated"
        else [{"maxInputTokens": 1024, "mode": "colocated"}, {"mode": "disaggregated"}]
    )
    spec = {**MANIFEST["spec"], "decode": {"replicas": decode}, "routing": {"buckets": buckets}}
    if prefill:
        spec["prefill"] = {"replicas": prefill}
    candidate = Candidate(
        family, prefill, decode, "static 512", 1024 if prefill else None, api.parse_spec(spec)
    )
    result = {
        "failed": 0,
        "slo_attainment": 1.0,
        "goodput": 2.0,
        "overall": figures(*worst),
        "buckets": {"<=1024": figures(*short), ">1024": figures(*long)},
    }
    return judge(candidate, result, TARGETS)


def test_disaggregation_wins_when_long_prompts_break_the_short_ones_itl() -> None:
    trials = [
        trial("colocated", 0, 2, short=(0.2, 0.3), long=(0.8, 0.3)),
        trial("colocated", 0, 3, short=(0.2, 0.15), long=(0.7, 0.15)),
        trial("bucketed", 1, 2, short=(0.2, 0.05), long=(0.9, 0.06)),
    ]

    best = recommended(trials)

    assert best is trials[2]
    words = verdict(trials)
    assert words.startswith("Disaggregate: bucketed 1P+2D")
    assert "no colocated budget tried meets it" in words
    assert (
        "with 3 workers the best colocated budget (static 512) misses the ITL target in "
        "bucket <=1024: P99 150 ms against 100 ms" in words
    )
    pool = recommended_pool(MANIFEST, trials, best, "test plan")
    assert pool["spec"]["prefill"]["replicas"] == 1
    assert pool["spec"]["autoscaling"]["policy"]["prefillDecodeRatio"] == {"min": 0.5, "max": 0.5}
    assert pool["metadata"]["annotations"][PLAN_ANNOTATION] == "test plan"
    api.parse_pool(pool)


def test_colocated_is_kept_when_a_budget_meets_the_slo_with_as_few_workers() -> None:
    trials = [
        trial("colocated", 0, 2, short=(0.2, 0.05), long=(0.9, 0.08)),
        trial("bucketed", 1, 1, short=(0.2, 0.05), long=(0.9, 0.06)),
    ]

    assert recommended(trials) is trials[0]
    assert verdict(trials).startswith("Tune the token budget, do not disaggregate")
    pool = recommended_pool(MANIFEST, trials, trials[0], "test plan")
    assert "prefill" not in pool["spec"]


def test_no_recommendation_names_the_closest_miss() -> None:
    trials = [trial("colocated", 0, 3, short=(0.2, 0.05), long=(2.5, 0.05))]

    assert recommended(trials) is None
    assert "No pool tried meets the SLO" in verdict(trials)
    assert "misses the TTFT target in bucket >1024: P95 2500 ms against 1000 ms" in verdict(trials)


@pytest.mark.parametrize("meets", [True, False])
def test_the_table_has_a_row_per_trial(meets: bool) -> None:
    itl = 0.05 if meets else 0.5
    trials = [trial("colocated", 0, 1, short=(0.1, itl), long=(0.2, itl))]
    rows = table(trials).splitlines()
    assert len(rows) == 2
    assert rows[1].endswith("yes" if meets else "no")
