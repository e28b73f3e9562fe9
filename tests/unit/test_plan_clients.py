"""A request's overhead through the router: each answered request's time to its first
token less the predicted compute of its prompt's step."""

from __future__ import annotations

import pytest

from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.clients import request_overhead_s
from pdserve.workers.plan.costs import StepCost

COST = StepCost(
    base_s=0.004,
    per_decode_token_s=0.0,
    per_prefill_token_s=6e-5,
    per_decode_key_s=0.0,
    per_prefill_key_s=8e-8,
)


def answered(prompt: int, beyond_s: float, index: int = 0) -> RequestRecord:
    record = RequestRecord(index, "chat", prompt, 1, scheduled_at=0.0, sent_at=10.0)
    step = COST.seconds(StepFeatures(prefill_tokens=prompt, prefill_keys=prompt * prompt))
    record.chunk_times.append(10.0 + step + beyond_s)
    record.chunk_tokens.append(1)
    record.finished = True
    return record


def test_the_overhead_is_the_typical_time_beyond_the_prompts_compute() -> None:
    records = [answered(16, 0.020, 0), answered(64, 0.022, 1), answered(40, 0.050, 2)]
    failed = RequestRecord(3, "chat", 32, 1, scheduled_at=0.0, sent_at=10.0)
    failed.fail("connection reset", 10.5)

    assert request_overhead_s([*records, failed], COST) == pytest.approx(0.022)


def test_no_answered_request_measures_no_overhead() -> None:
    failed = RequestRecord(0, "chat", 32, 1, scheduled_at=0.0, sent_at=10.0)
    failed.fail("connection reset", 10.5)
    assert request_overhead_s([failed], COST) is None
    # A prompt whose compute was overestimated does not make the overhead negative.
    assert request_overhead_s([answered(16, -0.001)], COST) == 0.0
