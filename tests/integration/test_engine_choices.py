"""n > 1: the prompt computed once, its blocks shared by the choices, each choice the
answer a request of its own with its seed would get."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.engine import LLMEngine
from support.engine import choice_tokens, make_engine, run_outputs

N = 4
PROMPT_LEN = 90  # 5 full blocks of 16 and a partial one: the fork copies it


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(3, 1000, (PROMPT_LEN,), generator=generator).tolist()


def single(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    outputs, _ = run_outputs(engine, {"one": (prompt, params)})
    return [token for output in outputs["one"] for token in output.new_token_ids]


def test_greedy_choices_each_equal_the_single_answer(
    small_model_dir: Path, prompt: list[int]
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, seed=9)
    expected = single(make_engine(small_model_dir), prompt, params)
    engine = make_engine(small_model_dir, budget=32)
    outputs, steps = run_outputs(engine, {"n": (prompt, replace(params, n=N))})
    assert choice_tokens(outputs["n"], N) == [expected] * N
    # The prompt's 6 blocks were allocated once: then one copy of the partial block
    # for each choice but the first, and each choice's own blocks as it grows (from
    # token 96 on: one more block each).
    assert engine.kv_cache.pool.num_allocated_total == 6 + (N - 1) + N
    assert sum(1 for step in steps if step.stats.num_prefill_chunks) == -(-PROMPT_LEN // 32)
    assert engine.kv_cache.pool.usage == 0.0
    last = [output for output in outputs["n"] if output.finished]
    assert len(last) == 1 and last[0] is outputs["n"][-1]


def test_seeded_choices_each_equal_a_request_with_seed_plus_index(
    small_model_dir: Path, prompt: list[int]
) -> None:
    base = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, ignore_eos=True, seed=40)
    expected = [
        single(make_engine(small_model_dir), prompt, base.choice(index)) for index in range(N)
    ]
    assert len({tuple(tokens) for tokens in expected}) > 1  # the seeds do differ
    engine = make_engine(small_model_dir, budget=64)
    outputs, _ = run_outputs(engine, {"n": (prompt, replace(base, n=N))})
    assert choice_tokens(outputs["n"], N) == expected
    assert engine.kv_cache.pool.usage == 0.0


def test_choices_that_end_at_the_fork_hold_no_blocks(
    small_model_dir: Path, prompt: list[int]
) -> None:
    engine = make_engine(small_model_dir)
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=2, n=N, logprobs=2)
    outputs, _ = run_outputs(engine, {"n": (prompt, params)})
    assert [output.index for output in outputs["n"]] == list(range(N))
    assert all(len(output.new_token_ids) == 1 for output in outputs["n"])
    assert all(output.logprobs is not None and len(output.logprobs) == 1 for output in outputs["n"])
    assert [output.finished for output in outputs["n"]] == [False] * (N - 1) + [True]
    assert engine.kv_cache.pool.num_allocated_total == 6  # the prompt's, no copies
    assert engine.kv_cache.pool.usage == 0.0


def test_scoring_with_n_answers_every_choice_with_the_prompt(
    small_model_dir: Path, prompt: list[int]
) -> None:
    engine = make_engine(small_model_dir)
    params = SamplingParams(max_tokens=0, n=3, prompt_logprobs=1)
    outputs, _ = run_outputs(engine, {"n": (prompt, params)})
    assert [output.index for output in outputs["n"]] == [0, 1, 2]
    for output in outputs["n"]:
        assert output.new_token_ids == () and output.prompt_logprobs is not None
        assert len(output.prompt_logprobs) == PROMPT_LEN
    assert outputs["n"][-1].finished and engine.kv_cache.pool.usage == 0.0


def test_a_choice_ends_alone_and_the_request_with_its_last_choice(
    small_model_dir: Path, prompt: list[int]
) -> None:
    engine = make_engine(small_model_dir)
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=1, n=3, ignore_eos=True)
    engine.add_request("n", prompt, params)
    while not engine.step().outputs:  # until the fork
        pass
    ended = engine.abort("n", index=1)
    assert ended is not None and ended.index == 1 and not ended.finished
    assert ended.finish_reason is not None and ended.finish_reason.value == "abort"
    tokens: dict[int, int] = {0: 0, 2: 0}
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens[output.index] += len(output.new_token_ids)
    assert tokens == {0: 49, 2: 49}
    assert engine.kv_cache.pool.usage == 0.0


def test_aborting_a_forked_request_frees_every_choice(
    small_model_dir: Path, prompt: list[int]
) -> None:
    engine = make_engine(small_model_dir)
    params = SamplingParams(max_tokens=50, temperature=0.0, n=N, ignore_eos=True)
    engine.add_request("n", prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.kv_cache.pool.usage > 0
    ended = engine.abort("n")
    assert ended is not None and ended.finished
    assert not engine.has_unfinished() and engine.kv_cache.pool.usage == 0.0


def test_choices_preempted_or_short_of_blocks_still_give_the_single_answer(
    small_model_dir: Path, prompt: list[int]
) -> None:
    # 8 blocks: the prompt takes 6, so two choices get a copy of the partial block
    # at the fork and the fourth computes the prompt again (from the prefix cache);
    # the running ones preempt each other as they grow.
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = single(make_engine(small_model_dir), prompt, params)
    engine = make_engine(small_model_dir, budget=64, num_blocks=8)
    outputs, steps = run_outputs(engine, {"n": (prompt, replace(params, n=N))})
    assert choice_tokens(outputs["n"], N) == [expected] * N
    assert sum(step.stats.num_preemptions for step in steps) > 0
    assert sum(step.stats.num_prefill_chunks for step in steps) > -(-PROMPT_LEN // 64)
    assert engine.kv_cache.pool.usage == 0.0


def test_n_larger_than_the_batch_is_refused(small_model_dir: Path, prompt: list[int]) -> None:
    engine = make_engine(small_model_dir, max_num_seqs=4)
    with pytest.raises(ValueError, match="n must not exceed"):
        engine.add_request("n", prompt, SamplingParams(n=5))
