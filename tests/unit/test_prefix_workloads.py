"""Workloads with planned prefix sharing: Mooncake traces and multi-turn chat, their
prompts (the same block, the same tokens) and the bound on reusable tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.workers.bench.config import BenchConfig, ConfigError
from pdserve.workers.bench.plan import build_plan, planned_prompt
from pdserve.workers.bench.prefix_workloads import (
    MULTI_TURN,
    PrefixRow,
    load_prefix_trace,
    multi_turn_rows,
    prompt_text,
    reusable_tokens,
)
from pdserve.workers.model.tokenizer import Tokenizer


def write_trace(path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1200, "output_length": 8, "hash_ids": [1, 2, 9]},
        {"timestamp": 250, "input_length": 100, "output_length": 4, "hash_ids": [5]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_mooncake_trace_is_read_in_arrival_order(tmp_path: Path) -> None:
    rows = load_prefix_trace(write_trace(tmp_path / "t.jsonl"))
    assert [row.offset_s for row in rows] == [0.0, 0.25, 0.5]
    assert rows[2].hash_ids == (1, 2, 9) and rows[2].input_tokens == 1200


def test_prompts_share_exactly_their_shared_blocks_in_tokens(small_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(small_model_dir)
    scale = 1 / 8
    a = prompt_text(0, PrefixRow(0, (1, 2, 3), 1536, 1), scale)
    b = prompt_text(0, PrefixRow(0, (1, 2, 9), 1536, 1), scale)
    shared = prompt_text(0, PrefixRow(0, (1, 2), 1024, 1), scale)
    assert a.startswith(shared) and b.startswith(shared) and a != b
    tokens = [tokenizer.encode(text, add_special_tokens=False) for text in (shared, a, b)]
    assert tokens[1][: len(tokens[0])] == tokens[0] == tokens[2][: len(tokens[0])]
    # The bound counts the shared full blocks of the second prompt, nothing of the first.
    block = 16
    assert reusable_tokens(tokens[1:], block) == len(tokens[0]) // block * block


def test_multi_turn_conversations_grow_over_shared_system_prompts() -> None:
    rows = multi_turn_rows(seed=1, rate=0.5, count=40)
    assert len(rows) == 40
    systems = {row.hash_ids[:4] for row in rows}
    assert len(systems) == 4  # four system prompts, shared by every conversation
    by_history = {row.hash_ids: row for row in rows}
    for row in rows:
        earlier = row.hash_ids[:-2]  # the previous turn's prompt: less an answer and a message
        if len(row.hash_ids) > 5:
            assert earlier in by_history and by_history[earlier].offset_s < row.offset_s


def test_a_multi_turn_plan_sends_text_prompts() -> None:
    config = BenchConfig(url="http://x", workload=MULTI_TURN, num_requests=12, rate=1.0)
    plan = build_plan(config)
    assert len(plan) == 12 and all(p.prefix is not None for p in plan)
    prompt = planned_prompt(config, plan[0])
    assert isinstance(prompt, str) and prompt.startswith(" ")


def test_a_share_of_prefix_groups_keeps_whole_groups_and_their_times(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 100 * i, "input_length": 600, "output_length": 2, "hash_ids": [i % 10, i]}
        for i in range(200)
    ]
    trace = tmp_path / "groups.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = BenchConfig(url="http://x", trace=trace, trace_prefix_share=0.5, seed=3)
    plan = build_plan(config)
    groups = {p.prefix.hash_ids[0] for p in plan if p.prefix is not None}
    assert 0 < len(groups) < 10  # some groups drawn, not all
    assert len(plan) == 20 * len(groups)  # every request of a drawn group, none other
    first = min(p.prefix.hash_ids[1] for p in plan if p.prefix is not None)
    assert plan[0].offset_s == 0.0
    assert plan[1].offset_s == (plan[1].prefix.hash_ids[1] - first) / 10  # type: ignore[union-attr]
    again = build_plan(BenchConfig(url="http://x", trace=trace, trace_prefix_share=0.5, seed=3))
    assert again == plan  # the seed decides the draw
    with pytest.raises(ConfigError, match="trace-prefix-share"):
        BenchConfig(url="http://x", workload="chat", trace_prefix_share=0.5)
