"""The five rollback conditions, judged on figures (pure: numbers in, breaches out).

Each condition compares the canary's figures in one input-length bucket with the
stable revision's over the same time range (the last `durationSeconds` of the step's
window), against its `threshold` and `baselineRatio` from the spec. A figure that is
missing (no data for it in the range) never fires a condition: no evidence, no verdict.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.operator.api import (
    ErrorRates,
    ItlOverTarget,
    PreemptionsWithTtft,
    RevisionFigures,
    RollbackConditionName,
    RollbackConditions,
    ShortRequestsSlowed,
    UtilisationUpGoodputDown,
)
from pdserve.operator.rollout.decision import Breach
from pdserve.protocol.routing import Slo


def judge(
    name: RollbackConditionName,
    conditions: RollbackConditions,
    slo: Slo,
    bucket: str,
    short: bool,
    canary: RevisionFigures,
    baseline: RevisionFigures,
) -> Breach | None:
    """Whether condition `name` fires in `bucket` (`short`: the first bucket, where
    short requests are), and on which figures."""
    message: str | None
    if name == "itlOverTarget":
        message = itl_over_target(conditions.itl_over_target, slo, canary, baseline)
    elif name == "preemptionsWithTtft":
        message = preemptions_with_ttft(conditions.preemptions_with_ttft, canary, baseline)
    elif name == "shortRequestsSlowed":
        rule = conditions.short_requests_slowed
        message = short_requests_slowed(rule, canary, baseline) if short else None
    elif name == "utilisationUpGoodputDown":
        rule_u = conditions.utilisation_up_goodput_down
        message = utilisation_up_goodput_down(rule_u, canary, baseline)
    else:
        message = error_rates(conditions.error_rates, canary, baseline)
    if message is None:
        return None
    return Breach(name, bucket, canary, baseline, f"{name} in bucket {bucket}: {message}")


def itl_over_target(
    rule: ItlOverTarget, slo: Slo, canary: RevisionFigures, baseline: RevisionFigures
) -> str | None:
    """The canary's P99 ITL above `threshold` times the pool's ITL target (and above
    `baselineRatio` times the stable revision's, when a ratio is given)."""
    target = slo.itl_seconds
    itl = canary.itl_p99_seconds
    if target is None or itl is None:
        return None
    bound = (1.0 if rule.threshold is None else rule.threshold) * target
    if itl <= bound or not _above_baseline(itl, baseline.itl_p99_seconds, rule.baseline_ratio):
        return None
    stable = baseline.itl_p99_seconds
    return f"P99 ITL {_ms(itl)} over {_ms(bound)} (target {_ms(target)}){_vs(stable, _ms)}"


def preemptions_with_ttft(
    rule: PreemptionsWithTtft, canary: RevisionFigures, baseline: RevisionFigures
) -> str | None:
    """Preemptions per request and TTFT P95 both above `baselineRatio` times the stable
    revision's (preemptions above `threshold` too, when given)."""
    ratio = rule.baseline_ratio if rule.baseline_ratio is not None else 1.0
    rate, ttft = canary.preemption_rate, canary.ttft_p95_seconds
    if rate is None or ttft is None or baseline.ttft_p95_seconds is None:
        return None
    if rate <= (rule.threshold or 0.0) or rate <= ratio * (baseline.preemption_rate or 0.0):
        return None
    if ttft <= ratio * baseline.ttft_p95_seconds:
        return None
    return (
        f"preemptions {rate:.3g} per request (stable {baseline.preemption_rate or 0:.3g}) "
        f"with TTFT P95 {_ms(ttft)} (stable {_ms(baseline.ttft_p95_seconds)}), over {ratio:g}x"
    )


def short_requests_slowed(
    rule: ShortRequestsSlowed, canary: RevisionFigures, baseline: RevisionFigures
) -> str | None:
    """Short requests' P95 end-to-end latency at `baselineRatio` times the stable
    revision's or more (and above `threshold` seconds, when given)."""
    ratio = rule.baseline_ratio if rule.baseline_ratio is not None else 2.0
    e2e, stable = canary.short_e2e_p95_seconds, baseline.short_e2e_p95_seconds
    if e2e is None or stable is None or e2e < ratio * stable or e2e <= (rule.threshold or 0.0):
        return None
    return f"short requests' P95 latency {_ms(e2e)}, {ratio:g}x or more of stable {_ms(stable)}"


def utilisation_up_goodput_down(
    rule: UtilisationUpGoodputDown, canary: RevisionFigures, baseline: RevisionFigures
) -> str | None:
    """KV cache usage above the stable revision's while goodput (the share of requests
    meeting the SLO) is under `baselineRatio` times its."""
    ratio = rule.baseline_ratio if rule.baseline_ratio is not None else 0.9
    usage, goodput = canary.kv_cache_usage, canary.goodput
    stable_usage, stable_goodput = baseline.kv_cache_usage, baseline.goodput
    if None in (usage, goodput, stable_usage, stable_goodput):
        return None
    assert usage is not None and goodput is not None
    assert stable_usage is not None and stable_goodput is not None
    if usage <= stable_usage or goodput >= ratio * stable_goodput:
        return None
    return (
        f"KV usage {usage:.0%} over stable {stable_usage:.0%} while goodput "
        f"{goodput:.0%} is under {ratio:g}x stable {stable_goodput:.0%}"
    )


def error_rates(rule: ErrorRates, canary: RevisionFigures, baseline: RevisionFigures) -> str | None:
    """The error, cancel or timeout rate above `threshold` and above `baselineRatio`
    times the stable revision's."""
    ratio = rule.baseline_ratio if rule.baseline_ratio is not None else 1.5
    floor = rule.threshold if rule.threshold is not None else 0.0
    rates: dict[str, Callable[[RevisionFigures], float | None]] = {
        "error": lambda f: f.error_rate,
        "cancel": lambda f: f.cancel_rate,
        "timeout": lambda f: f.timeout_rate,
    }
    for kind, rate_of in rates.items():
        rate, stable = rate_of(canary), rate_of(baseline)
        if rate is None or rate <= floor or rate <= ratio * (stable or 0.0):
            continue
        return f"{kind} rate {rate:.1%} over {floor:.1%} and {ratio:g}x stable {stable or 0:.1%}"
    return None


def _above_baseline(value: float, stable: float | None, ratio: float | None) -> bool:
    """Whether `value` is above `ratio` times `stable` (true when no ratio is asked
    for; false when one is and the stable figure is missing)."""
    if ratio is None:
        return True
    return stable is not None and value > ratio * stable


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms"


def _vs(stable: float | None, show: Callable[[float], str]) -> str:
    return "" if stable is None else f", stable {show(stable)}"
