"""The SLO planner (planner.py): decisions from observations, with every limit."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest

from pdserve.operator import api
from pdserve.operator.scaling.planner import (
    Decision,
    Memory,
    Observation,
    Replicas,
    RoleLoad,
    Settings,
    plan,
)

Obj = dict[str, Any]
TTFT, ITL = 1.0, 0.05  # targets, seconds


def settings(
    policy: Obj | None = None, *, with_prefill: bool = True, **autoscaling: Any
) -> Settings:
    spec: Obj = {
        "model": {"name": "m", "path": "/m"},
        "decode": {"engine": {"maxNumSeqs": 10, "maxNumBatchedTokens": 512}},
        "slo": {"ttft": {"seconds": TTFT, "percentile": 95}, "itl": {"seconds": ITL}},
        "autoscaling": {
            "enabled": True,
            "prefill": {"minReplicas": 1, "maxReplicas": 6},
            "decode": {"minReplicas": 1, "maxReplicas": 6},
            "policy": {
                "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 60,
                "cooldownSeconds": 0,
                "maxScaleUpStep": 4,
                "maxScaleDownStep": 1,
                "minRequests": 10,
                **(policy or {}),
            },
            **autoscaling,
        },
    }
    if with_prefill:
        spec["prefill"] = {}
    return Settings.of(api.parse_spec(spec))


def quiet_load(workers: int = 1) -> RoleLoad:
    return RoleLoad(workers=workers, waiting=0.0, running=1.0, kv_cache_usage=0.1)


def observe(
    *,
    ttft: Mapping[str, float] | None = None,
    itl: float | None = 0.6 * ITL,
    requests: float = 100.0,
    rate: float = 2.0,
    prefill: RoleLoad | None = None,
    decode: RoleLoad | None = None,
    disaggregated_rate: float | None = None,
) -> Observation:
    return Observation(
        request_rate=rate,
        requests=requests,
        disaggregated_rate=disaggregated_rate,
        ttft=dict(ttft or {"colocated": 0.5 * TTFT, "disaggregated": 0.5 * TTFT}),  # type: ignore[arg-type]
        itl=itl,
        prefill=prefill or quiet_load(),
        decode=decode or quiet_load(),
    )


def replicas(
    prefill: int = 1, decode: int = 1, ready: Mapping[str, int] | None = None
) -> dict[api.Role, Replicas]:
    ready = ready or {}
    return {
        "prefill": Replicas(prefill, ready.get("prefill", prefill)),
        "decode": Replicas(decode, ready.get("decode", decode)),
    }


def once(
    the_settings: Settings,
    observation: Observation,
    current: Mapping[api.Role, Replicas] | None = None,
    memory: Memory | None = None,
    now: float = 1000.0,
) -> dict[api.Role, Decision]:
    decisions, _ = plan(the_settings, observation, current or replicas(), memory or Memory(), now)
    return decisions


class Run:
    """Decisions over time, applied to the replicas as the operator would."""

    def __init__(self, the_settings: Settings, prefill: int = 1, decode: int = 1) -> None:
        self.settings = the_settings
        self.replicas: dict[api.Role, int] = {"prefill": prefill, "decode": decode}
        self.memory = Memory()
        self.changes: list[tuple[float, Decision]] = []

    def step(self, observation: Observation, now: float) -> dict[api.Role, Decision]:
        current = {role: Replicas(n, n) for role, n in self.replicas.items()}
        decisions, self.memory = plan(self.settings, observation, current, self.memory, now)
        for role, decision in decisions.items():
            if decision.direction != "none":
                self.changes.append((now, decision))
            self.replicas[role] = decision.desired
        return decisions


# --- what each signal scales ------------------------------------------------------------


def test_ttft_of_disaggregated_requests_adds_prefill_workers_in_proportion() -> None:
    decisions = once(settings(), observe(ttft={"disaggregated": 2.5 * TTFT, "colocated": 0.3}))
    assert decisions["prefill"].desired == 3  # ceil(1 x 2.5)
    assert decisions["prefill"].reason == "TTFTAboveTarget"
    assert "TTFT p95 (disaggregated) 2.5 over 1" in decisions["prefill"].message
    assert decisions["decode"].direction == "none"


def test_itl_adds_decode_workers_and_leaves_prefill() -> None:
    decisions = once(settings(), observe(itl=1.5 * ITL), replicas(decode=2))
    assert decisions["decode"].desired == 3  # ceil(2 x 1.5)
    assert decisions["decode"].reason == "ITLAboveTarget"
    assert decisions["prefill"].direction == "none"


def test_ttft_of_colocated_requests_adds_decode_workers_not_prefill() -> None:
    decisions = once(settings(), observe(ttft={"colocated": 2 * TTFT, "disaggregated": 0.2}))
    assert decisions["decode"].desired == 2
    assert decisions["decode"].reason == "TTFTAboveTarget"
    assert decisions["prefill"].direction == "none"


def test_without_a_prefill_pool_every_ttft_scales_decode() -> None:
    decisions = once(
        settings(with_prefill=False), observe(ttft={"disaggregated": 2 * TTFT}), replicas(decode=2)
    )
    assert set(decisions) == {"decode"}
    assert decisions["decode"].desired == 4


def test_prefill_queue_adds_prefill_workers() -> None:
    waiting = RoleLoad(workers=2, waiting=8.0, running=1.0, kv_cache_usage=0.2)
    decisions = once(settings({"prefillQueueHigh": 4}), observe(prefill=waiting), replicas(2))
    assert decisions["prefill"].desired == 4  # ceil(2 x 8 / 4)
    assert decisions["prefill"].reason == "PrefillQueueHigh"


@pytest.mark.parametrize(
    ("load", "reason"),
    [
        (RoleLoad(workers=1, waiting=0, running=2, kv_cache_usage=0.95), "KVCacheUsageHigh"),
        (RoleLoad(workers=1, waiting=0, running=10, kv_cache_usage=0.2), "BatchFull"),
    ],
)
def test_decode_load_adds_decode_workers(load: RoleLoad, reason: str) -> None:
    decisions = once(settings({"kvCacheUsageHigh": 0.8}), observe(decode=load))
    assert decisions["decode"].direction == "up"
    assert decisions["decode"].reason == reason


def test_latencies_of_too_few_requests_do_not_count() -> None:
    decisions = once(settings({"minRequests": 50}), observe(itl=3 * ITL, requests=20))
    assert decisions["decode"].direction == "none"


def test_disaggregated_traffic_brings_prefill_back_from_zero() -> None:
    bounds: Obj = {"prefill": {"minReplicas": 0, "maxReplicas": 3}}
    the_settings = settings(**bounds)
    decisions = once(
        the_settings, observe(ttft={"colocated": 0.2}, disaggregated_rate=0.5), replicas(0)
    )
    assert decisions["prefill"].desired == 1
    assert decisions["prefill"].reason == "DisaggregatedTraffic"


# --- holding, and scaling down -----------------------------------------------------------


def test_between_the_lines_nothing_moves() -> None:
    near = observe(ttft={"disaggregated": 0.9 * TTFT, "colocated": 0.9 * TTFT}, itl=0.9 * ITL)
    decisions = once(settings(), near, replicas(3, 3), Memory(since=0.0))
    assert all(d.direction == "none" for d in decisions.values())
    assert decisions["decode"].reason == "WithinTarget"


def test_scale_down_waits_for_a_whole_window_of_low_load_then_steps_one_at_a_time() -> None:
    run = Run(settings({"scaleDownStabilizationSeconds": 60}), prefill=3, decode=3)
    low = observe(ttft={"disaggregated": 0.2, "colocated": 0.2}, itl=0.2 * ITL)
    for now in range(0, 60, 5):
        decisions = run.step(low, float(now))
        assert all(d.direction == "none" for d in decisions.values()), now
        assert decisions["decode"].reason == "Stabilizing"
    run.step(low, 60.0)
    assert run.replicas == {"prefill": 2, "decode": 2}
    for now in range(65, 125, 5):
        run.step(low, float(now))
    assert run.replicas == {"prefill": 2, "decode": 2}  # the window holds recommendations of 2
    run.step(low, 125.0)
    assert run.replicas == {"prefill": 1, "decode": 1}


def test_no_scale_down_when_one_worker_fewer_would_be_too_busy() -> None:
    busy = RoleLoad(workers=2, waiting=0, running=4, kv_cache_usage=0.2)  # 4 of 9 slots
    fast = observe(decode=busy, ttft={"colocated": 0.2 * TTFT}, itl=0.2 * ITL)
    decisions = once(settings(), fast, replicas(1, 2), Memory(since=0.0))
    assert decisions["decode"].direction == "none"
    assert "too busy for one worker fewer" in decisions["decode"].message


def test_no_scale_down_when_one_worker_fewer_would_be_too_slow() -> None:
    # TTFT 0.6 of target on two prefill workers: under the 0.7 line, but one worker
    # doing the work of two would put it at 1.2, over the target: the pool would flap.
    the_settings = settings({"scaleDownStabilizationSeconds": 0})
    held = observe(ttft={"disaggregated": 0.6 * TTFT, "colocated": 0.2 * TTFT}, itl=0.2 * ITL)
    decisions = once(the_settings, held, replicas(2, 1), Memory(since=0.0))
    assert decisions["prefill"].direction == "none"
    assert "too slow for one worker fewer" in decisions["prefill"].message
    light = observe(ttft={"disaggregated": 0.3 * TTFT, "colocated": 0.2 * TTFT}, itl=0.2 * ITL)
    decisions = once(the_settings, light, replicas(2, 1), Memory(since=0.0))
    assert decisions["prefill"].desired == 1


def test_busy_workers_stay_while_too_few_requests_end_to_judge_their_latency() -> None:
    # Long streams: none ended in the window, so no latency is known, yet four run on
    # each decode worker. Taking one away could break the ITL target unseen.
    the_settings = settings({"scaleDownStabilizationSeconds": 0})
    streaming = RoleLoad(workers=2, waiting=0, running=4, kv_cache_usage=0.02)
    unmeasured = observe(requests=0.0, rate=0.0, itl=None, ttft={}, decode=streaming)
    decisions = once(the_settings, unmeasured, replicas(1, 2), Memory(since=0.0))
    assert decisions["decode"].direction == "none"
    assert decisions["decode"].reason == "TooFewRequests"


def test_an_idle_pool_goes_down_to_min_replicas() -> None:
    the_settings = settings({"scaleDownStabilizationSeconds": 0, "maxScaleDownStep": 10})
    idle = Observation(request_rate=0.0, requests=0.0, prefill=RoleLoad(2, 0, 0, 0.0))
    idle = Observation(**{**vars(idle), "decode": RoleLoad(4, 0, 0, 0.0)})
    decisions = once(the_settings, idle, replicas(2, 4))
    assert decisions["prefill"].desired == 1
    assert decisions["decode"].desired == 1
    assert decisions["decode"].reason == "Idle"


# --- limits -----------------------------------------------------------------------------


def test_max_replicas_caps_and_says_so() -> None:
    the_settings = settings(decode={"minReplicas": 1, "maxReplicas": 3})
    decisions = once(the_settings, observe(itl=4 * ITL), replicas(decode=2))
    assert decisions["decode"].desired == 3
    assert "maxReplicas 3" in decisions["decode"].message
    at_max = once(the_settings, observe(itl=4 * ITL), replicas(decode=3))
    assert at_max["decode"].direction == "none"
    assert at_max["decode"].reason == "AtMaxReplicas"


def test_replicas_outside_the_bounds_move_inside_at_once() -> None:
    the_settings = settings(decode={"minReplicas": 2, "maxReplicas": 3}, policy=None)
    decisions = once(
        the_settings, observe(), replicas(decode=7), Memory(last_scale={"decode": 999.0})
    )
    assert decisions["decode"].desired == 3
    assert decisions["decode"].reason == "OutsideBounds"


def test_step_limits_bound_each_move() -> None:
    decisions = once(settings({"maxScaleUpStep": 1}), observe(itl=5 * ITL))
    assert decisions["decode"].desired == 2
    assert "1 at a time" in decisions["decode"].message


def test_cooldown_holds_a_role_after_it_changed() -> None:
    the_settings = settings({"cooldownSeconds": 30})
    run = Run(the_settings)
    run.step(observe(itl=2 * ITL), 0.0)
    assert run.replicas["decode"] == 2
    decisions = run.step(observe(itl=2 * ITL), 20.0)
    assert decisions["decode"].reason == "CoolingDown"
    assert run.replicas["decode"] == 2
    run.step(observe(itl=2 * ITL), 31.0)
    assert run.replicas["decode"] == 4


def test_no_scale_up_while_the_last_one_is_not_ready() -> None:
    decisions = once(settings(), observe(itl=3 * ITL), replicas(decode=3, ready={"decode": 1}))
    assert decisions["decode"].direction == "none"
    assert decisions["decode"].reason == "WaitingForReplicas"


def test_up_stabilisation_ignores_a_single_spike() -> None:
    run = Run(settings({"scaleUpStabilizationSeconds": 10}))
    run.step(observe(), 0.0)
    run.step(observe(itl=3 * ITL), 5.0)  # one bad window
    run.step(observe(), 10.0)
    assert run.changes == []
    run.step(observe(itl=3 * ITL), 20.0)
    run.step(observe(itl=3 * ITL), 25.0)
    run.step(observe(itl=3 * ITL), 31.0)  # bad for a whole window
    assert run.replicas["decode"] == 3


def test_ratio_bound_caps_prefill_growth_and_decode_shrinking() -> None:
    bound = {"prefillDecodeRatio": {"max": 1.0}, "scaleDownStabilizationSeconds": 0}
    breach = observe(ttft={"disaggregated": 4 * TTFT, "colocated": 0.9 * TTFT})
    decisions = once(settings(bound), breach, replicas(1, 2))
    assert decisions["prefill"].desired == 2
    assert decisions["prefill"].reason == "RatioLimited"
    busy_prefill = RoleLoad(workers=2, waiting=2.0, running=1.0, kv_cache_usage=0.1)
    low = observe(
        ttft={"disaggregated": 0.2, "colocated": 0.2}, itl=0.1 * ITL, prefill=busy_prefill
    )
    shrink = once(settings(bound), low, replicas(2, 2))
    assert shrink["prefill"].desired == 2
    assert shrink["decode"].desired == 2  # no fewer decode workers than prefill workers
    assert shrink["decode"].reason == "RatioLimited"


def test_ratio_bound_min_keeps_enough_prefill() -> None:
    bound = {"prefillDecodeRatio": {"min": 0.5}, "scaleDownStabilizationSeconds": 0}
    low = observe(ttft={"disaggregated": 0.2, "colocated": 0.2}, itl=0.1 * ITL)
    decisions = once(settings(bound), low, replicas(2, 4))
    assert decisions["prefill"].desired == 2  # 4 decode workers need 2 prefill workers
    assert decisions["decode"].desired == 3


# --- no flapping -------------------------------------------------------------------------


def noisy(rng: random.Random, low: float, high: float) -> Observation:
    return observe(
        ttft={k: rng.uniform(low, high) * TTFT for k in ("colocated", "disaggregated")},
        itl=rng.uniform(low, high) * ITL,
        requests=rng.uniform(20, 200),
        decode=RoleLoad(2, 0, rng.uniform(1, 3), rng.uniform(0.1, 0.4)),
        prefill=RoleLoad(2, rng.uniform(0, 1), 1, 0.1),
    )


@pytest.mark.parametrize("seed", range(5))
def test_noise_under_the_target_changes_nothing(seed: int) -> None:
    rng = random.Random(seed)
    run = Run(settings({"scaleDownStabilizationSeconds": 120}), prefill=2, decode=2)
    for tick in range(600):
        run.step(noisy(rng, 0.72, 0.99), tick * 5.0)
    assert run.changes == []


@pytest.mark.parametrize("seed", range(5))
def test_noise_across_the_target_never_scales_back_within_a_window(seed: int) -> None:
    """Latencies jumping over the target now and then add workers; none of them is
    taken back while the noise lasts, and no change reverses one within the window."""
    rng = random.Random(seed)
    policy = {"scaleDownStabilizationSeconds": 120, "cooldownSeconds": 30, "maxScaleUpStep": 1}
    run = Run(settings(policy), prefill=2, decode=2)
    for tick in range(600):
        run.step(noisy(rng, 0.6, 1.15), tick * 5.0)
    directions = [d.direction for _, d in run.changes]
    assert "down" not in directions
    assert len(run.changes) <= 10  # bounded by max replicas, not by the noise


def test_memory_keeps_only_the_longest_window() -> None:
    run = Run(settings({"scaleDownStabilizationSeconds": 60}))
    for tick in range(1000):
        run.step(observe(), tick * 5.0)
    assert all(len(h) <= 13 for h in run.memory.recommendations.values())
