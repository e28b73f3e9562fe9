"""Fitting the step-cost model to a sweep: the engine's own model's terms
(`engine.step_cost`: a fixed cost, per decode and prefill token, per key attention
reads, every cost non-negative), fitted for the error the simulator pays for, the
relative one: least squares on errors relative to each measured step, so that the
short decode steps every stream's gaps are made of weigh as much as long prefill
steps (a fit on absolute seconds follows the long steps and misses the short ones by
half). Steps slowed by something outside their batch (another process on the core)
are weighted down (Huber, on the relative residual), as the engine's online fit does.
Where the sweep timed reference steps, each step may first be brought to the machine's
typical pace (its time scaled by the typical reference time over the one measured
beside it), so that the machine drifting while the batches were measured one after
another is not fitted as a cost of the batch measured then; that is done where it
predicts the steps as timed better than a constant pace does.
The sweep measures each point once a round over several rounds, in an order drawn
afresh each round (`sweep`), so that a slow stretch of the machine lands on different
points each round: the fit is made to each point's median step over its rounds, which
a step slowed by another process, or a round that ran slow there, does not move. Each
round is also fitted alone: how far the rounds' costs lie apart is the costs' spread.
Its error is measured on the steps it was fitted on and on design points held out."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

import numpy as np

from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import FitError, StepCost, StepSample
from pdserve.workers.plan.sweep import SweepPoint

# Every fourth point of the design is held out of the fit it is judged by.
HOLDOUT_EVERY = 4
HUBER_K = 1.5  # relative residuals past this many typical ones are weighted down
REWEIGHTS = 5
_FIELDS = ("base_s", "per_decode_token_s", "per_prefill_token_s", "per_decode_key_s",
           "per_prefill_key_s")  # fmt: skip


def fit_step_cost(samples: Sequence[StepSample]) -> StepCost:
    """The non-negative costs whose predictions are relatively closest to these steps."""
    terms = np.array([_terms(sample.features) for sample in samples])
    seconds = np.array([sample.seconds for sample in samples])
    weights = np.ones_like(seconds)
    coefficients = np.zeros(terms.shape[1])
    for _ in range(REWEIGHTS):
        coefficients = _non_negative_least_squares(
            terms / seconds[:, None] * weights[:, None], weights
        )
        residuals = np.abs(terms @ coefficients / seconds - 1.0)
        scale = max(float(np.median(residuals)) / 0.6745, 1e-9)
        weights = np.minimum(1.0, HUBER_K * scale / np.maximum(residuals, 1e-12))
    return StepCost(
        **{name: float(value) for name, value in zip(_FIELDS, coefficients, strict=True)}
    )


def _terms(features: StepFeatures) -> tuple[float, ...]:
    return (1.0, features.decode_tokens, features.prefill_tokens, features.decode_keys,
            features.prefill_keys)  # fmt: skip


def _non_negative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin |design x - target| with x >= 0: the best unconstrained solution over
    every set of terms left free (five terms: 31 sets), columns scaled to unit norm."""
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    scaled = design / norms
    best, best_residual = np.zeros(design.shape[1]), float(target @ target)
    for free in itertools.product((False, True), repeat=design.shape[1]):
        columns = [i for i, on in enumerate(free) if on]
        if not columns:
            continue
        solution, *_ = np.linalg.lstsq(scaled[:, columns], target, rcond=None)
        if (solution < 0).any():
            continue
        candidate = np.zeros(design.shape[1])
        candidate[columns] = solution
        residual = float(np.sum((scaled @ candidate - target) ** 2))
        if residual < best_residual:
            best, best_residual = candidate, residual
    result: np.ndarray = best / norms
    return result


def relative_errors(cost: StepCost, samples: Sequence[StepSample]) -> np.ndarray:
    """|predicted - measured| / measured, per step."""
    predicted = np.array([cost.seconds(s.features) for s in samples])
    measured = np.array([s.seconds for s in samples])
    errors: np.ndarray = np.abs(predicted - measured) / measured
    return errors


def typical_pace(samples: Sequence[StepSample]) -> float | None:
    """The median reference time of these steps; None unless every step has one."""
    references = [sample.reference_s for sample in samples]
    if not references or any(reference is None for reference in references):
        return None
    return float(np.median([float(r) for r in references if r is not None]))


def at_typical_pace(samples: Sequence[StepSample], typical: float) -> list[StepSample]:
    """The steps as they would have taken at the typical pace (their reference time
    `typical`)."""
    return [
        sample.model_copy(update={"seconds": sample.seconds * typical / sample.reference_s})
        if sample.reference_s is not None else sample
        for sample in samples
    ]  # fmt: skip


def timed_errors(
    cost: StepCost, samples: Sequence[StepSample], typical: float | None
) -> np.ndarray:
    """|predicted - measured| / measured against the steps as timed; with `typical`,
    each prediction at the pace of its step (its reference time over the typical)."""
    if typical is None:
        return relative_errors(cost, samples)
    predicted = np.array([
        cost.seconds(s.features) * (s.reference_s or typical) / typical for s in samples
    ])  # fmt: skip
    measured = np.array([s.seconds for s in samples])
    errors: np.ndarray = np.abs(predicted - measured) / measured
    return errors


def point_medians(measured: Sequence[tuple[SweepPoint, StepSample]]) -> list[StepSample]:
    """Each point's median step over its measurements: the step whose time is the
    median (the lower of the middle two), so that its features are those it was
    timed with."""
    by_point: dict[SweepPoint, list[StepSample]] = {}
    for point, sample in measured:
        by_point.setdefault(point, []).append(sample)
    return [
        sorted(samples, key=lambda sample: sample.seconds)[(len(samples) - 1) // 2]
        for samples in by_point.values()
    ]


def _fit(measured: Sequence[tuple[SweepPoint, StepSample]], typical: float | None) -> StepCost:
    """The fit to each point's median step, at the typical pace where one is given."""
    if typical is not None:
        paced = at_typical_pace([sample for _, sample in measured], typical)
        measured = [(point, sample) for (point, _), sample in zip(measured, paced, strict=True)]
    return fit_step_cost(point_medians(measured))


def fit_with_error(measured: Sequence[tuple[SweepPoint, StepSample]]) -> tuple[StepCost, FitError]:
    """The fit over every point's median step, its in-sample error, and the error on
    held-out points of a fit made without them, against the steps as timed. The
    machine's pace is taken into account where it predicts the steps better than a
    constant pace: a reference step's own jitter would otherwise move a quiet
    machine's steps."""
    timed = [sample for _, sample in measured]
    typical = typical_pace(timed)
    unpaced = timed_errors(_fit(measured, None), timed, None)
    paced = typical is not None and bool(
        timed_errors(_fit(measured, typical), timed, typical).mean() < unpaced.mean()
    )
    pace = typical if paced else None
    cost = _fit(measured, pace)
    errors = timed_errors(cost, timed, pace)
    points = sorted({point for point, _ in measured}, key=repr)
    held = {point for index, point in enumerate(points) if index % HOLDOUT_EVERY == 0}
    train = [(point, sample) for point, sample in measured if point not in held]
    test = [sample for point, sample in measured if point in held]
    holdout = timed_errors(_fit(train, pace), test, pace) if train and test else np.array([])
    return cost, FitError(
        samples=len(timed),
        rounds=len(rounds_of(measured)),
        mean_abs=float(errors.mean()) if errors.size else 0.0,
        p90_abs=float(np.percentile(errors, 90)) if errors.size else 0.0,
        max_abs=float(errors.max()) if errors.size else 0.0,
        holdout_samples=len(test),
        holdout_mean_abs=float(holdout.mean()) if holdout.size else None,
        paced=paced,
        unpaced_mean_abs=float(unpaced.mean()) if typical is not None and unpaced.size else None,
    )


def rounds_of(
    measured: Sequence[tuple[SweepPoint, StepSample]],
) -> dict[int, list[tuple[SweepPoint, StepSample]]]:
    """The steps by the round they were measured in (a sweep in one pass: one)."""
    rounds: dict[int, list[tuple[SweepPoint, StepSample]]] = {}
    for point, sample in measured:
        rounds.setdefault(sample.round or 0, []).append((point, sample))
    return dict(sorted(rounds.items()))


def round_costs(measured: Sequence[tuple[SweepPoint, StepSample]], paced: bool) -> list[StepCost]:
    """Each round's steps fitted alone (at the typical pace of all of them where the
    fit took the pace into account): how far the costs move from round to round."""
    typical = typical_pace([sample for _, sample in measured]) if paced else None
    return [_fit(steps, typical) for steps in rounds_of(measured).values()]


def median_difference(later: Sequence[float], sooner: Sequence[float]) -> float:
    """The median of the pairwise differences of two samples (Hodges-Lehmann): one
    slow request in either moves it less than it moves a difference of medians."""
    return float(statistics.median(a - b for a in later for b in sooner))
