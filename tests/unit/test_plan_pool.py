"""The simulated pool: the router's bucket and load choice, the hand-off's time and
its failure policy, on a profile whose steps and hand-offs take fixed times (so that
every figure is known exactly)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.plan.costs import StepCost
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.routing import Route
from pdserve.workers.plan.scenario import ScenarioError, parse_scenario
from pdserve.workers.plan.worker import SimWorker
from pdserve.workers.router.kv_costs import StepCosts
from pdserve.workers.router.kv_room import BatchRoom
from pdserve.workers.router.workers import Worker
from support.plan import constant_profile, model_config_dir, profile_with, scenario_line

STEP_S, HANDOFF_S = 0.01, 0.05
SPLIT: list[dict[str, Any]] = [
    {"maxInputTokens": 64, "mode": "colocated"},
    {"mode": "disaggregated"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_config_dir(tmp_path_factory.mktemp("model"))


def run(
    model_dir: Path,
    line: str,
    requests: list[tuple[float, int, int]],
    cost: StepCost | None = None,
) -> PoolSimulation:
    """The requests through the scenario's pool; steps take STEP_S, or `cost`."""
    plan = [PlannedRequest(i, at, n, out, "t") for i, (at, n, out) in enumerate(requests)]
    profile = (
        constant_profile(model_dir, STEP_S, HANDOFF_S)
        if cost is None
        else profile_with(model_dir, cost)
    )
    simulation = PoolSimulation(
        parse_scenario(line),
        profile,
        Traffic(plan, seed=0, vocab_size=256, drain_timeout_s=60.0, horizon_s=None),
    )
    simulation.run()
    return simulation


def ttft(simulation: PoolSimulation, index: int) -> float:
    record = simulation.records[index]
    assert record.sent_at is not None
    return record.chunk_times[0] - record.sent_at


def test_a_long_prompt_is_prefilled_on_a_prefill_worker_and_pays_for_its_hand_off(
    model_dir: Path,
) -> None:
    line = scenario_line("split", [], num_prefill=1, buckets=SPLIT)
    simulation = run(model_dir, line, [(0.0, 32, 4), (1.0, 200, 4)])

    short, long = simulation.records
    assert (short.mode, long.mode) == ("colocated", "disaggregated")
    assert ttft(simulation, 0) == pytest.approx(STEP_S)  # one step prefills it
    assert ttft(simulation, 1) == pytest.approx(STEP_S + HANDOFF_S)
    assert all(r.finished and sum(r.chunk_tokens) == 4 for r in simulation.records)
    prefill = simulation.workers["http://prefill-0.sim:8000"]
    assert prefill.num_steps == 1
    assert len(prefill.engine.leases) == 0  # its blocks went once the KV was sent


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hand_off_without_free_blocks_follows_the_failure_policy(
    model_dir: Path, policy: str
) -> None:
    # The decode worker holds one long prompt at a time: the second one's reservation
    # finds no blocks, and does not wait for them.
    decode = ["--num-kv-blocks", "16", "--transfer-failure-policy", policy]
    decode += ["--handoff-room-wait", "0"]
    line = scenario_line("small", decode, num_prefill=1, buckets=SPLIT)
    simulation = run(model_dir, line, [(0.0, 200, 20), (0.0, 200, 20)])

    first, second = simulation.records
    assert first.finished and first.mode == "disaggregated"
    assert simulation.handoff_failures == {"no_blocks": 1}
    if policy == "recompute":
        assert second.finished and second.mode == "colocated"
    else:
        assert second.error is not None and "no_blocks" in second.error


def test_a_hand_off_without_free_blocks_waits_for_the_running_answer_to_free_them(
    model_dir: Path,
) -> None:
    # As above, with the default wait: the second prompt's blocks come free when the
    # first answer ends (20 tokens, a step each), and it is handed off then.
    decode = ["--num-kv-blocks", "16"]
    line = scenario_line("small", decode, num_prefill=1, buckets=SPLIT)
    simulation = run(model_dir, line, [(0.0, 200, 20), (0.0, 200, 20)])

    first, second = simulation.records
    assert simulation.handoff_failures == {}
    assert first.finished and second.finished
    assert (first.mode, second.mode) == ("disaggregated", "disaggregated")
    assert first.ended_at is not None
    assert ttft(simulation, 1) >= first.ended_at + HANDOFF_S


class SharedPrefixTraffic(Traffic):
    """Prompts that are each the start of one token sequence: each holds the shorter."""

    def prompt(self, planned: PlannedRequest) -> list[int]:
        return list(range(3, 3 + planned.input_tokens))


@pytest.mark.parametrize("policy", ["kv-aware", "load"])
def test_a_decode_worker_holding_a_disaggregated_prompt_but_a_few_tokens_computes_them(
    model_dir: Path, policy: str
) -> None:
    # The decode worker's blocks are not the table's size: the router's index refuses
    # it and knows nothing of its cache (as a lagging index), so the second prompt goes
    # disaggregated by its length. The decode worker holds the first 64 of its 100
    # tokens: under KV-aware routing it computes the other 36 itself (at most the 64 the
    # pool serves colocated); routing by load only, it hands the prompt off.
    line = json.loads(scenario_line("held", ["--block-size", "32"], num_prefill=1, buckets=SPLIT))
    line["routing"]["routingPolicy"] = {"type": policy}
    plan = [PlannedRequest(0, 0.0, 64, 4, "t"), PlannedRequest(1, 1.0, 100, 4, "t")]
    traffic = SharedPrefixTraffic(plan, 0, 256, drain_timeout_s=60.0, horizon_s=None)
    profile = constant_profile(model_dir, STEP_S, HANDOFF_S)
    simulation = PoolSimulation(parse_scenario(json.dumps(line)), profile, traffic)
    first, second = simulation.run()

    assert first.mode == "colocated" and first.finished and second.finished
    prefill = simulation.workers["http://prefill-0.sim:8000"]
    assert simulation.handoff_failures == {}
    if policy == "kv-aware":
        assert (second.mode, simulation.handoffs_skipped, prefill.num_steps) == ("colocated", 1, 0)
        assert second.usage_cached_tokens == 64
        assert ttft(simulation, 1) == pytest.approx(STEP_S)
    else:
        assert (second.mode, simulation.handoffs_skipped, prefill.num_steps) == (
            "disaggregated", 0, 1,
        )  # fmt: skip


def test_the_router_spreads_requests_over_the_least_loaded_workers(model_dir: Path) -> None:
    line = scenario_line("two", [], num_decode=2)
    simulation = run(model_dir, line, [(0.0, 32, 50)] * 4)

    assert all(record.finished for record in simulation.records)
    steps = [worker.num_steps for worker in simulation.workers.values()]
    assert steps[0] == steps[1] > 0  # two requests each, in lockstep


def test_a_scenario_with_bad_worker_flags_is_refused_naming_them(model_dir: Path) -> None:
    with pytest.raises(ScenarioError, match="--max-num-seqs"):
        parse_scenario(scenario_line("bad", ["--max-num-seqs", "none"]))


def test_a_prompt_longer_than_the_model_takes_is_refused_and_the_rest_are_served(
    model_dir: Path,
) -> None:
    for buckets in (({"mode": "colocated"},), SPLIT):
        line = scenario_line("long", [], num_prefill=1, buckets=buckets)
        simulation = run(model_dir, line, [(0.0, 4000, 4), (0.1, 300, 4), (0.2, 20, 4)])

        refused, *served = simulation.records
        assert refused.error is not None and refused.error.startswith("HTTP 400")
        assert all(record.finished for record in served)


def test_a_worker_publishes_what_its_steps_cost_once_its_model_has_learned(
    model_dir: Path,
) -> None:
    """The costs the KV-aware router prices a worker at are the worker's own steps':
    nothing before its cost model warms up, then what each step really took."""
    cost = StepCost(
        base_s=0.004, per_decode_token_s=1e-3, per_prefill_token_s=2e-4,
        per_decode_key_s=0.0, per_prefill_key_s=0.0,
    )  # fmt: skip
    line = scenario_line("one", [])
    (worker,) = run(model_dir, line, [(0.0, 40, 6)], cost).workers.values()
    assert worker.published_load()["step_costs"] is None  # 6 steps: still warming up

    requests = [(0.05 * i, 40 + 16 * i, 12 + i) for i in range(8)]
    (worker,) = run(model_dir, line, requests, cost).workers.values()
    published = StepCosts.of(worker.published_load()["step_costs"])
    assert published is not None
    assert published.base_s == pytest.approx(cost.base_s, rel=0.05)
    assert published.prefill_token_s == pytest.approx(cost.per_prefill_token_s, rel=0.05)
    assert published.decode_token_s == pytest.approx(cost.per_decode_token_s, rel=0.05)
    # And the prompt tokens it learned its prefill costs from (the 8 prompts', less
    # what the fit has forgotten of them since).
    assert 0 < published.prefill_tokens < sum(tokens for _, tokens, _ in requests)
    assert published.step_tokens > 0


def test_a_worker_publishes_its_seats_blocks_and_when_its_running_requests_end(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the router predicts a seat or blocks wait from: a worker with two seats
    and six requests publishes a full batch, its blocks and the steps its running
    requests have left, in a form the router takes."""
    published: list[dict[str, Any]] = []
    publish = SimWorker.published_load

    def recorded(worker: SimWorker) -> dict[str, Any]:
        published.append(publish(worker))
        return published[-1]

    monkeypatch.setattr(SimWorker, "published_load", recorded)
    line = scenario_line("one", ["--max-num-seqs", "2", "--num-kv-blocks", "64"])
    run(model_dir, line, [(0.0, 40, 40)] * 6)
    rooms = [BatchRoom.of(body) for body in published]
    assert rooms and all(room is not None for room in rooms)
    full = [room for room in rooms if room is not None and len(room.finishing) == 2]
    assert full, published
    for room in full:
        assert room.max_num_seqs == 2 and room.num_kv_blocks == 64
        # About 40 prompt tokens and up to 40 more: at most a step of prompt and 40
        # steps of decodes left, blocks held, fewer free.
        assert all(0 <= steps <= 41 and held >= 1 for steps, held in room.finishing)
        assert room.kv_blocks_free < 64
    steps_left = sorted({room.finishing[0][0] for room in full})
    assert len(steps_left) > 1  # they count down as the requests decode


def test_the_router_counts_a_prompt_waiting_on_the_worker_that_computes_it(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the router's `Outstanding` counts it: a colocated prompt waits on its decode
    worker, a disaggregated one on its prefill worker, each until its first token (the
    simulated pool counted only the prefill worker's, and whole prompts)."""
    sent: list[tuple[str, int]] = []
    prefill_sent = Worker.prefill_sent

    def recorded(worker: Worker, tokens: int, keys: Sequence[int] = ()) -> None:
        sent.append((worker.url, tokens))
        prefill_sent(worker, tokens, keys)

    monkeypatch.setattr(Worker, "prefill_sent", recorded)
    line = scenario_line("split", [], num_prefill=1, buckets=SPLIT)
    simulation = run(model_dir, line, [(0.0, 32, 4), (1.0, 200, 4)])

    assert sent == [("http://decode-0.sim:8000", 32), ("http://prefill-0.sim:8000", 200)]
    for workers in simulation.sets.values():
        for worker in workers:  # every prompt's count let go at its first token
            assert worker.prefill_tokens == 0 and worker.prefill_prompts == []


def test_a_routes_waiting_tokens_are_those_the_computing_worker_lacks() -> None:
    decode, prefill = Worker("http://d", "decode"), Worker("http://p", "prefill")
    colocated = Route("colocated", decode, None, 32, "cache", 0)
    assert colocated.prefills is decode and colocated.uncached(40) == 8
    split = Route("disaggregated", decode, prefill, 32, "cache", 16)
    assert split.prefills is prefill and split.uncached(40) == 24
