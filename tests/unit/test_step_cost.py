"""The step-cost model on synthetic steps: known costs, noise and outliers."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.workers.engine.step_cost import StepCostModel, StepFeatures

# Seconds per unit: base, decode token, prefill token, decode key, prefill key. Each term
# is a sizeable part of a typical step below, so each is identifiable.
TRUE_COSTS = np.array([0.01, 0.0008, 0.0004, 1e-6, 5e-8])


def synthetic_step(rng: np.random.Generator) -> StepFeatures:
    """A step as serving makes them: some decodes over some context, often a prefill
    chunk somewhere in a prompt."""
    decodes = int(rng.integers(0, 33))
    context = int(rng.integers(16, 4097))
    chunk = int(rng.integers(2, 513)) if rng.random() < 0.6 else 0
    start = int(rng.integers(0, 3001))
    return StepFeatures(decodes, chunk, decodes * context, chunk * (start + chunk))


def true_seconds(features: StepFeatures) -> float:
    counts = (
        1,
        features.decode_tokens,
        features.prefill_tokens,
        features.decode_keys,
        features.prefill_keys,
    )
    return float(np.dot(TRUE_COSTS, counts))


def trained(steps: int, noise: float, outlier_share: float, seed: int = 0) -> StepCostModel:
    """A model taught `steps` synthetic steps with multiplicative noise and a share of
    outliers (steps stalled by 200 ms, as a descheduled thread would be)."""
    rng = np.random.default_rng(seed)
    model = StepCostModel()
    for _ in range(steps):
        features = synthetic_step(rng)
        seconds = true_seconds(features) * (1.0 + noise * rng.standard_normal())
        if rng.random() < outlier_share:
            seconds += 0.2
        model.update(features, seconds)
    return model


def test_recovers_known_costs_from_noisy_steps() -> None:
    model = trained(3000, noise=0.01, outlier_share=0.0)
    assert np.array(model.coefficients) == pytest.approx(TRUE_COSTS, rel=0.05)


def test_outliers_barely_move_the_fit() -> None:
    # 3% of steps stalled by 200 ms (about the cost of a whole typical step): a plain
    # least-squares fit would put them into the base cost.
    model = trained(3000, noise=0.01, outlier_share=0.03)
    assert np.array(model.coefficients) == pytest.approx(TRUE_COSTS, rel=0.1)
    assert model.coefficients[0] < TRUE_COSTS[0] + 0.003  # base: +6 ms if it took them in


def test_predictions_match_new_steps() -> None:
    model = trained(2000, noise=0.03, outlier_share=0.0)
    rng = np.random.default_rng(99)
    for _ in range(50):
        features = synthetic_step(rng)
        seconds = true_seconds(features)
        assert model.predict(features) == pytest.approx(seconds, rel=0.05, abs=0.002)


def test_margin_covers_the_prediction_errors_of_mixed_steps() -> None:
    model = trained(3000, noise=0.05, outlier_share=0.0)
    rng = np.random.default_rng(7)
    mixed = [
        f
        for f in (synthetic_step(rng) for _ in range(3000))
        if f.decode_tokens and f.prefill_tokens
    ]
    errors = [true_seconds(f) * 0.05 * rng.standard_normal() for f in mixed]
    # The margin is a high quantile of such errors: above most, not absurdly above all.
    assert np.quantile(errors, 0.9) < model.margin_s < 3 * max(errors)


def test_costs_never_go_negative_on_steps_that_barely_vary() -> None:
    # The same eight decodes step after step, one more token of context each time:
    # base, decode tokens and decode keys are nearly collinear.
    rng = np.random.default_rng(3)
    model = StepCostModel()
    model.update(StepFeatures(prefill_tokens=1560, prefill_keys=1560 * 195), 0.7)
    for step in range(200):
        features = StepFeatures(decode_tokens=8, decode_keys=8 * (196 + step))
        model.update(features, 0.03 * (1.0 + 0.2 * rng.standard_normal()))
    assert all(cost >= 0 for cost in model.coefficients)
    assert model.predict(StepFeatures(decode_tokens=8, decode_keys=8 * 400)) == pytest.approx(
        0.03, rel=0.25
    )
    # What it learned about prefill survives the long run of decodes.
    assert model.coefficients[2] > 0


def test_follows_a_device_that_slows_down() -> None:
    rng = np.random.default_rng(5)
    model = StepCostModel()
    for slowdown in (1.0, 2.0):
        for _ in range(1500):
            features = synthetic_step(rng)
            model.update(features, slowdown * true_seconds(features))
    assert np.array(model.coefficients) == pytest.approx(2.0 * TRUE_COSTS, rel=0.05)


def test_features_of_a_step_count_what_attention_reads() -> None:
    from pdserve.protocol.sampling import SamplingParams
    from pdserve.workers.engine.request import Request
    from pdserve.workers.engine.scheduler import ScheduledChunk

    params = SamplingParams(max_tokens=4)
    short = Request("short", list(range(10)), params)
    long = Request("long", list(range(100)), params)
    prompt = Request("prompt", list(range(300)), params)
    chunks = [
        ScheduledChunk(short, 10, 1, is_prefill=False),
        ScheduledChunk(long, 99, 1, is_prefill=False),
        ScheduledChunk(prompt, 128, 64, is_prefill=True),
    ]
    features = StepFeatures.of(chunks)
    # The decodes' contexts (11 and 100 tokens) are too far apart to share a padded
    # call: each reads its own; the chunk's 64 queries read the 192 tokens up to its end.
    assert features == StepFeatures(
        decode_tokens=2, prefill_tokens=64, decode_keys=111, prefill_keys=64 * 192
    )
    # Contexts within half of each other are one call, padded to the longest.
    assert StepFeatures.of_spans([(59, 1), (99, 1)]).decode_keys == 200


def test_the_errors_of_a_model_still_learning_leave_the_margin_once_it_has_learned() -> None:
    # Decodes only at first: the prefill terms are unknown. Then long prompts arrive,
    # exactly as the device runs them (no noise): once the fit has learned their cost,
    # nothing justifies a margin, though its first guesses at them were far off.
    rng = np.random.default_rng(5)
    model = StepCostModel()
    for _ in range(100):
        decodes = int(rng.integers(1, 33))
        features = StepFeatures(decodes, 0, decodes * int(rng.integers(16, 4097)), 0)
        model.update(features, true_seconds(features))
    mixed = [synthetic_step(rng) for _ in range(400)]
    mixed = [f for f in mixed if f.decode_tokens and f.prefill_tokens][:120]
    for features in mixed:
        model.update(features, true_seconds(features))
    typical = float(np.median([true_seconds(f) for f in mixed]))
    assert model.margin_s < 0.05 * typical


def test_the_prompt_tokens_learned_from_are_forgotten_as_the_fit_forgets() -> None:
    """What a worker publishes as the evidence behind its prefill costs: one 512-token
    chunk, then 200 decode steps, weigh 512 x 0.995^200 (about 188 tokens)."""
    model = StepCostModel()
    model.update(StepFeatures(prefill_tokens=512, prefill_keys=512 * 512), 0.1)
    assert model.estimate().prefill_tokens == 512
    for _ in range(200):
        model.update(StepFeatures(decode_tokens=4, decode_keys=4 * 600), 0.01)
    assert model.estimate().prefill_tokens == pytest.approx(512 * 0.995**200)
    model.update(StepFeatures(decode_tokens=1, prefill_tokens=100, prefill_keys=100), 0.02)
    assert model.estimate().prefill_tokens == pytest.approx(512 * 0.995**201 + 100)
