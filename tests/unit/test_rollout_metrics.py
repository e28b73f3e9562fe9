"""The rollout metrics follow a rollout's statuses: each decision counted once, the
revisions' weights and the step in force, and a revision gone leaves no weight."""

from __future__ import annotations

from datetime import UTC, datetime

from pdserve.operator.api import RolloutStrategy
from pdserve.operator.rollout import decision
from pdserve.operator.rollout.metrics import RolloutMetrics

NOW = datetime(2026, 1, 1, tzinfo=UTC)
STRATEGY = RolloutStrategy.model_validate(
    {"type": "canary", "steps": [{"weight": 20, "analysisSeconds": 1}]}
)


def sample(metrics: RolloutMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(
        name, {"pool_namespace": "", "pool": "p", "role": "decode", **labels}
    )


def test_weights_step_and_decisions_follow_the_rollout() -> None:
    metrics = RolloutMetrics()
    started = decision.start("old", "new", STRATEGY, NOW)
    metrics.record("p", "decode", started, decided=True)
    assert sample(metrics, "pdserve_rollout_weight", revision="old") == 80
    assert sample(metrics, "pdserve_rollout_weight", revision="new") == 20
    assert sample(metrics, "pdserve_rollout_step") == 1
    assert sample(metrics, "pdserve_rollout_decisions_total", action="wait", reason="Started") == 1
    aborted = decision.decide(STRATEGY, started, None, NOW, manual="abort")
    metrics.record("p", "decode", aborted, decided=True)
    assert sample(metrics, "pdserve_rollout_weight", revision="old") == 100
    assert sample(metrics, "pdserve_rollout_weight", revision="new") is None
    assert sample(metrics, "pdserve_rollout_step") == 0
    labels = {"action": "abort", "reason": "ManualAbort"}
    assert sample(metrics, "pdserve_rollout_decisions_total", **labels) == 1
