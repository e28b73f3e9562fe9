"""Continuous batching, prefix caching and preemption, observed through outputs and
the engine's own counters."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.protocol.sampling import SamplingParams
from support.engine import GREEDY, make_engine, run_to_completion


def random_prompts(count: int, seed: int, low: int = 5, high: int = 400) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def alone(model_dir: Path, prompts: list[list[int]], **kwargs: int) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        tokens, _ = run_to_completion(make_engine(model_dir, **kwargs), [prompt])  # type: ignore[arg-type]
        outputs.extend(tokens)
    return outputs


def test_concurrent_requests_equal_their_outputs_alone(small_model_dir: Path) -> None:
    prompts = random_prompts(8, seed=1)
    together, steps = run_to_completion(make_engine(small_model_dir, budget=128), prompts)
    assert together == alone(small_model_dir, prompts)
    # They really shared steps: some step ran decodes and a prefill chunk together.
    assert any(s.stats.num_decode_tokens and s.stats.num_prefill_chunks for s in steps)
    assert max(s.stats.num_running for s in steps) > 1


def test_requests_arriving_mid_stream_join_the_batch(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir, budget=64)
    prompts = random_prompts(3, seed=2)
    engine.add_request("first", prompts[0], GREEDY)
    tokens: dict[str, list[int]] = {"first": [], "late-0": [], "late-1": []}
    for _ in range(12):
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    engine.add_request("late-0", prompts[1], GREEDY)
    engine.add_request("late-1", prompts[2], GREEDY)
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    assert list(tokens.values()) == alone(small_model_dir, prompts)


def test_repeated_prefix_is_served_from_cache(small_model_dir: Path) -> None:
    shared = random_prompts(1, seed=3, low=200, high=201)[0]
    engine = make_engine(small_model_dir, budget=512)
    first, steps_first = run_to_completion(engine, [[*shared, 11, 12, 13]])
    second, steps_second = run_to_completion(engine, [[*shared, 11, 12, 13]])
    hits_first = sum(s.stats.prefix_cache_hits for s in steps_first)
    hits_second = sum(s.stats.prefix_cache_hits for s in steps_second)
    assert hits_first == 0
    assert hits_second == (len(shared) + 3 - 1) // 16 * 16  # every full block but the last
    assert second == first
    cold = make_engine(small_model_dir, budget=512, prefix_caching=False)
    assert run_to_completion(cold, [[*shared, 11, 12, 13]])[0] == first
    # Less computed the second time.
    assert sum(s.stats.num_tokens for s in steps_second) < sum(
        s.stats.num_tokens for s in steps_first
    )


def test_preemption_when_cache_is_too_small(small_model_dir: Path) -> None:
    prompts = random_prompts(6, seed=4, low=60, high=100)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # 6 requests need ~6 * 9 blocks at their longest; 24 blocks force preemptions.
    small = make_engine(small_model_dir, budget=256, num_blocks=24)
    tokens, steps = run_to_completion(small, prompts, params)
    assert sum(s.stats.num_preemptions for s in steps) > 0
    assert small.scheduler.num_preemptions > 0
    big = make_engine(small_model_dir, budget=256, num_blocks=256)
    assert tokens == run_to_completion(big, prompts, params)[0]
    assert all(len(t) == 40 for t in tokens)
    assert small.kv_cache.pool.usage == 0.0


def test_seeded_sampling_is_reproducible_in_any_batch(small_model_dir: Path) -> None:
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    together, _ = run_to_completion(make_engine(small_model_dir), prompts, params)
    assert together[0] == run_to_completion(make_engine(small_model_dir), prompts[:1], params)[0][0]
    greedy, _ = run_to_completion(make_engine(small_model_dir), prompts[:1])
    assert together[0] != greedy[0][:16]  # it really sampled


def test_abort_frees_blocks(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir, budget=64)
    engine.add_request("gone", random_prompts(1, seed=6, low=300, high=301)[0], GREEDY)
    engine.step()
    assert engine.kv_cache.pool.usage > 0
    engine.abort("gone")
    assert engine.kv_cache.pool.usage == 0.0
    assert not engine.has_unfinished()
