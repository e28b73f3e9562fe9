"""What a plan says: the table of what it tried, the pool it recommends (the fewest
workers meeting the SLO), and in words whether disaggregation beats more budget
tuning for this trace, and which bucket's figure decides it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.operator import api
from pdserve.operator.planning.search import Figure, Trial

PLAN_ANNOTATION = "pdserve.dev/plan"


def recommended(trials: Sequence[Trial]) -> Trial | None:
    """The trial meeting the SLO with the fewest workers; between equals, colocated
    (no hand-off to run), then the most requests meeting every target, then the most
    headroom."""
    meeting = [t for t in trials if t.meets]
    return min(meeting, key=_preference, default=None)


def _preference(trial: Trial) -> tuple[int, bool, float, float]:
    attainment = trial.result.get("slo_attainment")
    return (
        trial.candidate.workers,
        trial.candidate.family != "colocated",
        -(attainment if attainment is not None else 0.0),
        trial.worst_overall,
    )


def verdict(trials: Sequence[Trial]) -> str:
    """The answer in words."""
    best = recommended(trials)
    colocated = _fewest(trials, ("colocated",))
    split = _fewest(trials, ("bucketed", "disaggregated"))
    if best is None:
        closest = min(trials, key=lambda t: t.worst_overall, default=None)
        if closest is None:
            return "No pool was tried: the bounds leave no candidate."
        return (
            "No pool tried meets the SLO within the bounds. The closest, "
            f"{closest.candidate.name}, {_miss(closest.worst)}."
        )
    if best.candidate.family == "colocated":
        other = (
            f"the best disaggregated pool needs {split.candidate.workers} workers"
            if split is not None
            else "no disaggregated pool tried meets it"
        )
        return (
            f"Tune the token budget, do not disaggregate: colocated with budget "
            f"{best.candidate.budget} meets the SLO with {best.candidate.workers} workers "
            f"({other})."
        )
    deciding = _best_at(trials, ("colocated",), best.candidate.workers)
    needs = (
        f"colocated needs {colocated.candidate.workers}"
        if colocated is not None
        else "no colocated budget tried meets it within the bounds"
    )
    answer = (
        f"Disaggregate: {best.candidate.name} meets the SLO with "
        f"{best.candidate.workers} workers; {needs}."
    )
    if deciding is not None:
        answer += (
            f" What decides it: with {best.candidate.workers} workers the best colocated "
            f"budget ({deciding.candidate.budget}) {_miss(deciding.worst)}."
        )
    return answer


def _fewest(trials: Sequence[Trial], families: Sequence[str]) -> Trial | None:
    meeting = [t for t in trials if t.meets and t.candidate.family in families]
    return min(meeting, key=lambda t: (t.candidate.workers, t.worst_overall), default=None)


def _best_at(trials: Sequence[Trial], families: Sequence[str], workers: int) -> Trial | None:
    """The family's trial with the most headroom among those of at most `workers`."""
    tried = [t for t in trials if t.candidate.family in families and t.candidate.workers <= workers]
    return min(tried, key=lambda t: (-t.candidate.workers, t.worst_overall), default=None)


def _miss(figure: Figure | None) -> str:
    if figure is None:
        return "failed requests"
    target = figure.target
    where = "over all requests" if figure.bucket == "all" else f"in bucket {figure.bucket}"
    verb = "misses" if figure.ratio > 1 else "comes closest to"
    return (
        f"{verb} the {target.metric} target {where}: {target.label.upper()} "
        f"{figure.seconds * 1000:.0f} ms against {target.seconds * 1000:g} ms"
    )


def table(trials: Sequence[Trial]) -> str:
    """One row per trial, in the order tried."""
    rows = [("pool", "workers", "TTFT", "ITL", "SLO met by", "goodput", "worst bucket", "meets")]
    for trial in trials:
        result = trial.result
        figures = {f.target.metric: f for f in trial.overall}
        worst = trial.worst
        rows.append((
            trial.candidate.name,
            str(trial.candidate.workers),
            _ms(figures.get("TTFT")),
            _ms(figures.get("ITL")),
            _share(result.get("slo_attainment")),
            _rate(result.get("goodput")),
            "-" if worst is None else f"{worst.target.metric} {worst.bucket} x{worst.ratio:.2f}",
            "yes" if trial.meets else "no",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def _ms(figure: Figure | None) -> str:
    if figure is None:
        return "-"
    # The mean over the simulation's draws, and how far the draws fell from it.
    spread = "" if figure.spread_s is None else f"±{figure.spread_s * 1000:.0f}"
    return f"{figure.target.label} {figure.seconds * 1000:.0f}{spread}ms"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}/s"


def recommended_pool(
    manifest: Mapping[str, Any], trials: Sequence[Trial], best: Trial, provenance: str
) -> dict[str, Any]:
    """The user's manifest with the recommended spec, as a manifest to apply: a
    disaggregated pool's planner is bounded to the prefill:decode ratios the plan
    found meeting the SLO, and the plan is recorded in an annotation. Validated as
    the API validates manifests (InvalidPoolError)."""
    spec = api.dump(best.candidate.spec)
    ratios = [
        t.candidate.prefill / t.candidate.decode
        for t in trials
        if t.meets and t.candidate.prefill and t.candidate.family == best.candidate.family
    ]
    if best.candidate.prefill and ratios:
        policy = spec.setdefault("autoscaling", {}).setdefault("policy", {})
        # Rounded outwards, so that the ratios found stay inside the bound.
        low, high = math.floor(min(ratios) * 1000) / 1000, math.ceil(max(ratios) * 1000) / 1000
        policy["prefillDecodeRatio"] = {"min": low, "max": high}
    metadata = dict(manifest.get("metadata") or {})
    metadata["annotations"] = {**(metadata.get("annotations") or {}), PLAN_ANNOTATION: provenance}
    planned = {**manifest, "metadata": metadata, "spec": spec}
    planned.pop("status", None)
    api.parse_pool(planned)
    return planned
