"""Workload plans: lengths, mix, prompts and configuration checks."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from pdserve.workers.bench import cli
from pdserve.workers.bench.config import BenchConfig, ConfigError
from pdserve.workers.bench.plan import build_plan, prompt_tokens
from pdserve.workers.bench.prefix_workloads import MULTI_TURN
from pdserve.workers.bench.workloads import WORKLOADS

URL = "http://127.0.0.1:1"


def test_lengths_stay_in_their_class_ranges() -> None:
    for name, workload in WORKLOADS.items():
        plan = build_plan(BenchConfig(URL, workload=name, num_requests=300, rate=math.inf))
        classes = {c.name: c for c, _ in workload.mix}
        for request in plan:
            spec = classes[request.kind]
            assert spec.input.low <= request.input_tokens <= spec.input.high
            assert spec.output.low <= request.output_tokens <= spec.output.high


def test_mixed_is_mostly_chat_with_some_rag() -> None:
    plan = build_plan(BenchConfig(URL, workload="mixed", num_requests=2000, rate=math.inf))
    kinds = Counter(p.kind for p in plan)
    assert kinds["rag"] / len(plan) == pytest.approx(0.15, abs=0.03)
    assert kinds["chat"] + kinds["rag"] == len(plan)


def test_a_workloads_mean_tokens_are_those_of_its_drawn_requests() -> None:
    # The load step's capacity is counted in the mixed workload's average requests.
    assert WORKLOADS["mixed"].mean_tokens() == pytest.approx(0.85 * (160 + 80) + 0.15 * (2048 + 40))
    rng = np.random.default_rng(3)
    for workload in WORKLOADS.values():
        draws = [workload.sample(rng, None, None) for _ in range(4000)]
        drawn = sum(prompt + output for _, prompt, output in draws) / len(draws)
        assert drawn == pytest.approx(workload.mean_tokens(), rel=0.05)


def test_long_share_sets_the_mix_of_mixed() -> None:
    config = BenchConfig(URL, workload="mixed", long_share=0.4, num_requests=2000, rate=math.inf)
    kinds = Counter(p.kind for p in build_plan(config))
    assert kinds["rag"] / 2000 == pytest.approx(0.4, abs=0.03)
    with pytest.raises(ConfigError, match="long-share"):
        BenchConfig(URL, workload="chat", long_share=0.4, num_requests=1)


def test_limits_clip_lengths() -> None:
    config = BenchConfig(
        URL,
        workload="long",
        num_requests=50,
        rate=math.inf,
        max_input_tokens=500,
        max_output_tokens=100,
    )
    plan = build_plan(config)
    assert {p.input_tokens for p in plan} == {500}
    assert {p.output_tokens for p in plan} == {100}


def test_default_run_is_a_minute_at_the_default_rate() -> None:
    plan = build_plan(BenchConfig(URL, workload="mixed"))
    assert max(p.offset_s for p in plan) < 60.0
    assert len(plan) == pytest.approx(120, rel=0.3)


def test_seed_fixes_the_plan_and_rate_does_not_change_lengths() -> None:
    base = build_plan(BenchConfig(URL, workload="mixed", num_requests=40, seed=5))
    again = build_plan(BenchConfig(URL, workload="mixed", num_requests=40, seed=5))
    faster = build_plan(BenchConfig(URL, workload="mixed", num_requests=40, seed=5, rate=8.0))
    assert base == again
    assert [p.input_tokens for p in faster] == [p.input_tokens for p in base]
    assert [p.offset_s for p in faster] != [p.offset_s for p in base]


def test_prompts_are_exact_reproducible_and_distinct() -> None:
    prompts = [prompt_tokens(0, index, 300, 256) for index in range(50)]
    assert all(len(p) == 300 for p in prompts)
    assert min(min(p) for p in prompts) >= 3 and max(max(p) for p in prompts) < 256
    assert prompt_tokens(0, 7, 300, 256) == prompts[7]
    # No two prompts share even a short prefix: no accidental prefix-cache hits.
    assert len({tuple(p[:8]) for p in prompts}) == len(prompts)
    assert prompt_tokens(1, 7, 300, 256) != prompts[7]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of a workload and a trace"),
        ({"workload": "chat", "burstiness": 2.0}, "gamma"),
        ({"workload": "chat", "rate": 0.0}, "rate must be positive"),
        ({"workload": "chat", "rate": math.inf}, "infinite rate needs"),
        ({"workload": "chat", "concurrency_limit": 0}, "concurrency-limit must be positive"),
        ({"workload": "chat", "vocab_size": 3}, "vocab size"),
        ({"workload": "nope"}, "unknown workload"),
    ],
)
def test_bad_configurations_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BenchConfig(URL, **kwargs)  # type: ignore[arg-type]


def test_cli_offers_every_workload() -> None:
    assert set(cli.WORKLOAD_NAMES) == {*WORKLOADS, MULTI_TURN}
