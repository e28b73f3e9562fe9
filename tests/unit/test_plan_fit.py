"""The profile's fit: the step-cost model's terms, given a sweep's steps, settle on
the costs that made them; noisy long steps do not cost the short decode steps their
accuracy; the error is measured on steps it did not see."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.workers.plan.costs import StepCost, StepSample
from pdserve.workers.plan.fit import (
    fit_step_cost,
    fit_with_error,
    relative_errors,
    typical_pace,
)
from pdserve.workers.plan.sweep import SweepPoint

TRUE = StepCost(
    base_s=0.003,
    per_decode_token_s=4e-5,
    per_prefill_token_s=6e-5,
    per_decode_key_s=2e-8,
    per_prefill_key_s=5e-9,
)


def sweep(noise: float, seed: int = 0) -> list[tuple[SweepPoint, StepSample]]:
    """The full design's grid, each step timed by TRUE and off by up to `noise`."""
    rng = np.random.default_rng(seed)
    measured = []
    for context in (64, 256, 1024):
        for decodes in (0, 1, 4, 16, 32):
            for start in (0, 512):
                for prefill in (0, 32, 128, 512):
                    if prefill == 0 and decodes == 0:
                        continue
                    point = SweepPoint(context, decodes, prefill, start)
                    for repeat in range(3):
                        end = start + prefill
                        sample = StepSample(
                            decode_tokens=decodes,
                            prefill_tokens=prefill,
                            decode_keys=decodes * (context + repeat),
                            prefill_keys=prefill * end,
                            seconds=1.0,
                        )
                        seconds = TRUE.seconds(sample.features) * (1 + rng.uniform(-noise, noise))
                        measured.append((point, sample.model_copy(update={"seconds": seconds})))
    return measured


def test_the_fit_recovers_the_costs_of_exact_steps() -> None:
    cost = fit_step_cost([sample for _, sample in sweep(noise=0.0)])
    for name, value in TRUE.model_dump().items():
        assert getattr(cost, name) == pytest.approx(value, rel=0.02), name


def test_the_error_is_measured_in_and_out_of_sample() -> None:
    measured = sweep(noise=0.05)
    cost, error = fit_with_error(measured)

    assert error.samples == len(measured)
    assert error.mean_abs == pytest.approx(
        float(relative_errors(cost, [s for _, s in measured]).mean())
    )
    assert 0 < error.mean_abs < 0.05
    assert 0 < error.holdout_samples < len(measured)
    assert error.holdout_mean_abs is not None and error.holdout_mean_abs < 0.1


def test_short_decode_steps_keep_their_accuracy_beside_slowed_long_steps() -> None:
    # Long prefill steps slowed by up to twice their time (another process took the
    # core), short steps exact: the short ones are what every stream's gaps are made of.
    rng = np.random.default_rng(3)
    measured = [
        (point, sample.model_copy(update={"seconds": sample.seconds * rng.uniform(1.0, 2.0)}))
        if sample.prefill_tokens >= 512 else (point, sample)
        for point, sample in sweep(noise=0.0)
    ]  # fmt: skip
    cost = fit_step_cost([sample for _, sample in measured])
    decodes = [sample for _, sample in measured if sample.prefill_tokens == 0]
    assert float(relative_errors(cost, decodes).mean()) < 0.05


def drifting(measured: list[tuple[SweepPoint, StepSample]]) -> list[tuple[SweepPoint, StepSample]]:
    """The steps as a machine whose pace drifts from batch to batch times them: each
    batch (context, decodes) runs at a pace of its own, and so does the reference step
    timed beside it."""
    rng = np.random.default_rng(7)
    paces = {(p.context, p.decodes): rng.uniform(1.0, 2.5) for p, _ in measured}
    reference_alone_s = 0.01
    return [
        (point, sample.model_copy(update={
            "seconds": sample.seconds * paces[(point.context, point.decodes)],
            "reference_s": reference_alone_s * paces[(point.context, point.decodes)],
        }))
        for point, sample in measured
    ]  # fmt: skip


def test_a_machine_drifting_between_batches_is_not_fitted_as_their_cost() -> None:
    measured = drifting(sweep(noise=0.0))
    cost, error = fit_with_error(measured)

    # Every step brought to one pace: the costs are the true ones times that pace.
    pace = cost.base_s / TRUE.base_s
    for name, value in TRUE.model_dump().items():
        assert getattr(cost, name) == pytest.approx(value * pace, rel=0.02), name
    assert error.paced
    assert error.mean_abs < 0.01 and error.holdout_mean_abs is not None
    assert error.holdout_mean_abs < 0.01
    # A fit blind to the pace cannot follow the same timings.
    assert error.unpaced_mean_abs is not None and error.unpaced_mean_abs > 0.1


def test_a_reference_that_only_jitters_leaves_a_steady_machine_as_timed() -> None:
    # The machine keeps its pace; the reference step's own timing wobbles by a third.
    rng = np.random.default_rng(5)
    jitter: dict[tuple[int, int], float] = {}
    measured = []
    for point, sample in sweep(noise=0.02):
        batch = (point.context, point.decodes)
        jitter.setdefault(batch, 0.01 * rng.uniform(0.67, 1.33))
        measured.append((point, sample.model_copy(update={"reference_s": jitter[batch]})))
    cost, error = fit_with_error(measured)

    assert not error.paced
    assert error.mean_abs == error.unpaced_mean_abs
    assert error.mean_abs < 0.03
    assert cost.base_s == pytest.approx(TRUE.base_s, rel=0.1)


def test_steps_without_a_reference_are_fitted_as_timed() -> None:
    measured = sweep(noise=0.0)
    samples = [sample for _, sample in measured]
    assert typical_pace(samples) is None
    error = fit_with_error(measured)[1]
    assert not error.paced and error.unpaced_mean_abs is None
