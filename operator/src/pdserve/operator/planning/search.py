"""The search: candidate pools by growing worker count, each simulated and judged
against the pool's SLO, until each family has met it (or the bounds run out)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.operator import api
from pdserve.operator.planning.candidates import (
    Bounds,
    Candidate,
    candidates,
    largest_total,
    smallest_total,
)
from pdserve.operator.planning.simulator import PLACEMENTS, Simulator, scenario_line

ALL = "all"  # the bucket label of figures over every request


@dataclass(frozen=True)
class Target:
    """One latency target of the pool's SLO."""

    metric: str  # TTFT or ITL
    key: str  # its figures in a simulation's results
    seconds: float
    percentile: float

    @property
    def label(self) -> str:
        """The percentile's key in the results, e.g. p95."""
        return f"p{self.percentile:g}"


def targets_of(slo: api.SloSpec | None) -> list[Target]:
    """The pool's targets (a plan needs at least one)."""
    found = []
    if slo is not None and slo.ttft is not None:
        found.append(Target("TTFT", "ttft_s", slo.ttft.seconds, slo.ttft.percentile))
    if slo is not None and slo.itl is not None:
        found.append(Target("ITL", "itl_s", slo.itl.seconds, slo.itl.percentile))
    return found


@dataclass(frozen=True)
class Figure:
    """A target's percentile in one bucket (or over all requests) of one simulation."""

    target: Target
    bucket: str
    seconds: float  # the mean over the simulation's draws
    spread_s: float | None = None  # its standard deviation across them

    @property
    def ratio(self) -> float:
        """The figure over its target: above 1 misses it."""
        return self.seconds / self.target.seconds


@dataclass(frozen=True)
class Trial:
    """A candidate, its simulated figures and the verdict on them."""

    candidate: Candidate
    result: dict[str, Any]
    overall: tuple[Figure, ...]
    buckets: tuple[Figure, ...]

    @property
    def meets(self) -> bool:
        """Every request served, and every target met over all requests."""
        return self.result["failed"] == 0 and all(f.ratio <= 1.0 for f in self.overall)

    @property
    def worst(self) -> Figure | None:
        """The figure furthest over (or nearest to) its target, bucket by bucket."""
        return max(self.buckets or self.overall, key=lambda f: f.ratio, default=None)

    @property
    def worst_overall(self) -> float:
        """The highest ratio over all requests (infinite with failures)."""
        if self.result["failed"]:
            return float("inf")
        return max((f.ratio for f in self.overall), default=0.0)


def judge(candidate: Candidate, result: dict[str, Any], targets: Sequence[Target]) -> Trial:
    """A simulation's figures against the targets, overall and per bucket."""
    spread = result.get("spread") or {}
    overall = tuple(_figures(result["overall"], spread.get("overall"), ALL, targets))
    buckets = spread.get("buckets") or {}
    per_bucket = tuple(
        figure
        for label, figures in result["buckets"].items()
        for figure in _figures(figures, buckets.get(label), label, targets)
    )
    return Trial(candidate, result, overall, per_bucket)


def _figures(
    figures: dict[str, Any],
    spreads: dict[str, Any] | None,
    bucket: str,
    targets: Sequence[Target],
) -> list[Figure]:
    found = []
    for target in targets:
        values = figures.get(target.key)
        if values is not None and target.label in values:
            spread = ((spreads or {}).get(target.key) or {}).get(target.label)
            seconds = float(values[target.label])
            found.append(Figure(target, bucket, seconds, None if spread is None else float(spread)))
    return found


@dataclass(frozen=True)
class SearchSpace:
    """What a plan searches: the pool, its bounds, and how results are reported."""

    pool: str
    spec: api.ServingPoolSpec
    bounds: Bounds
    targets: tuple[Target, ...]
    buckets: tuple[int, ...]
    placement: str = PLACEMENTS[0]  # where the workers run (`simulator.PLACEMENTS`)

    @property
    def percentiles(self) -> list[float]:
        """The percentiles asked of the simulator: the targets' and the usual ones."""
        return sorted({50.0, 99.0, *(t.percentile for t in self.targets)})


def search(
    space: SearchSpace, simulator: Simulator, progress: Callable[[Trial], None]
) -> list[Trial]:
    """Every trial, smallest pools first; a family stops growing once it met the SLO,
    the search once colocated and a disaggregated family have met it."""
    trials: list[Trial] = []
    met: set[str] = set()
    for total in range(smallest_total(space.bounds), largest_total(space.bounds) + 1):
        for candidate in candidates(space.spec, space.bounds, total):
            if candidate.family in met:
                continue
            line = scenario_line(
                space.pool, candidate, space.percentiles, space.buckets, space.placement
            )
            trial = judge(candidate, simulator.run(line), space.targets)
            trials.append(trial)
            progress(trial)
        met |= {t.candidate.family for t in trials if t.meets}
        if "colocated" in met and met & {"bucketed", "disaggregated"}:
            break
    return trials
