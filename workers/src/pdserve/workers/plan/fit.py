"""Fitting the step-cost model to a sweep: the engine's own model (`engine.step_cost`:
non-negative least squares, Huber-weighted), given every step with equal weight, and
its error on the steps it was fitted on and on design points held out of the fit."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.workers.engine.step_cost import StepCostModel
from pdserve.workers.plan.costs import FitError, StepCost, StepSample
from pdserve.workers.plan.sweep import SweepPoint

# Every fourth point of the design is held out of the fit it is judged by.
HOLDOUT_EVERY = 4


def fit_step_cost(samples: Sequence[StepSample]) -> StepCost:
    """The coefficients the step-cost model settles on for these steps."""
    model = StepCostModel(forgetting=1.0, sweeps=25)
    for sample in samples:
        model.update(sample.features, sample.seconds)
    return StepCost.of(model.estimate())


def relative_errors(cost: StepCost, samples: Sequence[StepSample]) -> np.ndarray:
    """|predicted - measured| / measured, per step."""
    predicted = np.array([cost.seconds(s.features) for s in samples])
    measured = np.array([s.seconds for s in samples])
    errors: np.ndarray = np.abs(predicted - measured) / measured
    return errors


def fit_with_error(measured: Sequence[tuple[SweepPoint, StepSample]]) -> tuple[StepCost, FitError]:
    """The fit over every step, its in-sample error, and the error on held-out
    points of a fit made without them."""
    samples = [sample for _, sample in measured]
    cost = fit_step_cost(samples)
    errors = relative_errors(cost, samples)
    points = sorted({point for point, _ in measured}, key=repr)
    held = {point for index, point in enumerate(points) if index % HOLDOUT_EVERY == 0}
    train = [sample for point, sample in measured if point not in held]
    test = [sample for point, sample in measured if point in held]
    holdout = relative_errors(fit_step_cost(train), test) if train and test else np.array([])
    return cost, FitError(
        samples=len(samples),
        mean_abs=float(errors.mean()) if errors.size else 0.0,
        p90_abs=float(np.percentile(errors, 90)) if errors.size else 0.0,
        max_abs=float(errors.max()) if errors.size else 0.0,
        holdout_samples=len(test),
        holdout_mean_abs=float(holdout.mean()) if holdout.size else None,
    )
