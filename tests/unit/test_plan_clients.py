"""A request's overhead through the router: each answered request's time to its first
token less the predicted compute of its prompt's step (on a busy worker, less the wait
for the step under way and the decodes sharing its step too); the simulator charges a
request the busy figure where its decode worker already streams to others."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.clients import (
    BUSY_OUTPUT_TOKENS,
    BUSY_PROMPT_TOKENS,
    BUSY_STREAMS,
    request_overhead_s,
)
from pdserve.workers.plan.costs import ServingOverhead, StepCost
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from support.plan import constant_profile, model_config_dir, scenario_line

COST = StepCost(
    base_s=0.004,
    per_decode_token_s=0.0,
    per_prefill_token_s=6e-5,
    per_decode_key_s=0.0,
    per_prefill_key_s=8e-8,
)
COSTS = (COST, ServingOverhead())


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

    assert request_overhead_s([*records, failed], COSTS) == pytest.approx(0.022)


def test_a_prompts_step_is_charged_at_the_serving_workers_slower_compute() -> None:
    # The prompt's step took twice the sweep's compute: that is the mixed factor's,
    # not the request's overhead.
    record = answered(64, 0.020)
    record.chunk_times[0] += COST.seconds(StepFeatures(0, 64, 0, 64 * 64))
    slower = (COST, ServingOverhead(mixed_factor=2.0))
    assert request_overhead_s([record], slower) == pytest.approx(0.020)
    overhead = request_overhead_s([record], COSTS)
    assert overhead is not None and overhead > 0.020


def test_no_answered_request_measures_no_overhead() -> None:
    failed = RequestRecord(0, "chat", 32, 1, scheduled_at=0.0, sent_at=10.0)
    failed.fail("connection reset", 10.5)
    assert request_overhead_s([failed], COSTS) is None
    # A prompt whose compute was overestimated does not make the overhead negative.
    assert request_overhead_s([answered(16, -0.001)], COSTS) == 0.0


def test_on_a_busy_worker_the_step_under_way_and_the_decodes_beside_are_not_overhead() -> None:
    decodes, context = BUSY_STREAMS, BUSY_PROMPT_TOKENS + BUSY_OUTPUT_TOKENS // 2
    cost = COST.model_copy(update={"per_decode_token_s": 1e-3})
    mixed = cost.seconds(StepFeatures(decodes, 16, decodes * context, 16 * 16))
    waited = cost.seconds(StepFeatures(decodes, 0, decodes * context, 0)) / 2
    record = RequestRecord(0, "chat", 16, 1, scheduled_at=0.0, sent_at=10.0)
    record.chunk_times.append(10.0 + waited + mixed + 0.015)
    record.chunk_tokens.append(1)
    record.finished = True
    assert request_overhead_s([record], (cost, ServingOverhead()), decodes) == pytest.approx(0.015)


def test_a_request_pays_the_busy_overhead_where_its_decode_worker_streams_to_others(
    tmp_path: Path,
) -> None:
    profile = constant_profile(model_config_dir(tmp_path), 0.01).model_copy(
        update={"request_overhead_s": 0.005, "busy_request_overhead_s": 0.02}
    )  # fmt: skip
    # The first request finds the worker idle; the second arrives while it streams.
    plan = [PlannedRequest(0, 0.0, 16, 20, "t"), PlannedRequest(1, 0.05, 16, 1, "t")]
    line = scenario_line("busy", [])
    first, second = PoolSimulation(
        parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None)
    ).run()
    assert first.chunk_times[0] == pytest.approx(0.005 + 0.01)
    # Steps end at 0.015, 0.025, ...: its way in (0.02) ends at 0.07 mid-step; it waits
    # for the step under way (to 0.075), then its own step ends at 0.085.
    assert second.chunk_times[0] == pytest.approx(0.085)
    # Without a busy figure measured, the idle one holds.
    unmeasured = profile.model_copy(update={"busy_request_overhead_s": None})
    assert unmeasured.request_overhead(busy=True) == 0.005
