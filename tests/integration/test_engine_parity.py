"""The engine against a reference it did not write: Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationMixin

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine import attention
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.runner import ModelRunner
from support.engine import GREEDY, make_engine, run_to_completion

# float32 on both sides; differences come only from summation order.
LOGIT_ATOL = 2e-4
PROMPT_LEN = 300
# Its later chunks attend to a cached prefix of 512 tokens and more, split from there.
LONG_PROMPT_LEN = 1_500


@pytest.fixture(scope="module")
def reference(small_model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        small_model_dir, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, 1000, (PROMPT_LEN,), generator=generator).tolist()


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, computed chunk by chunk through the engine's
    own scheduler, runner and paged KV cache."""
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    rows = []
    while engine.scheduler.running or engine.scheduler.waiting:
        step = engine.scheduler.schedule()
        runner = engine.runner
        assert isinstance(runner, ModelRunner)  # the model's own runner, not a simulated one
        batch = runner.prepare(step, engine.kv_cache.block_table)
        every_row = torch.arange(batch.input_ids.shape[0])
        rows.append(
            runner.model(batch.input_ids, batch.positions, runner.kv_cache, batch.meta, every_row)
        )
        engine.scheduler.update(step)
        if engine.scheduler.running[0].num_computed_tokens == len(prompt):
            break
    return torch.cat(rows)


@pytest.mark.parametrize("chunk", [16, 37, 128, 512])
def test_prompt_logits_match_transformers(
    small_model_dir: Path, reference: torch.nn.Module, prompt: list[int], chunk: int
) -> None:
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    engine = make_engine(small_model_dir, budget=chunk)
    actual = prompt_logits(engine, prompt)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < LOGIT_ATOL


def test_greedy_tokens_identical_chunked_unchunked_transformers(
    small_model_dir: Path, reference: torch.nn.Module, prompt: list[int]
) -> None:
    assert isinstance(reference, GenerationMixin)  # a causal LM: it generates
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )
    expected = generated[0, len(prompt) :].tolist()
    for budget, chunked in [(16, True), (100, True), (512, False)]:
        engine = make_engine(small_model_dir, budget=budget, chunked=chunked)
        tokens, steps = run_to_completion(engine, [prompt], GREEDY)
        assert tokens[0] == expected, f"budget={budget} chunked={chunked}"
        prefill_steps = sum(1 for s in steps if s.stats.num_prefill_chunks)
        assert prefill_steps == (-(-PROMPT_LEN // budget) if chunked else 1)


def test_chunks_over_a_long_cached_prefix_match_transformers(
    small_model_dir: Path, reference: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks after the first 512 tokens attend to their cached keys and their own in
    two parts merged by log-sum-exp (from 512 here: the engine's threshold is a speed
    choice, and this model's positions end at 2,048): the logits and greedy tokens are
    transformers'."""
    budget = 256
    monkeypatch.setattr(attention, "SPLIT_MIN_CACHED", 512)
    split = attention._split_prefill_attention
    calls: list[int] = []

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return split(*args)

    monkeypatch.setattr(attention, "_split_prefill_attention", counted)
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 1000, (LONG_PROMPT_LEN,), generator=generator).tolist()
    assert isinstance(reference, GenerationMixin)  # a causal LM: it generates
    with torch.no_grad():
        expected_logits = reference(torch.tensor([prompt])).logits[0].float()
        generated = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )
    actual = prompt_logits(make_engine(small_model_dir, budget=budget), prompt)
    assert (actual - expected_logits).abs().max().item() < LOGIT_ATOL
    assert calls  # the later chunks were split
    tokens, _ = run_to_completion(make_engine(small_model_dir, budget=budget), [prompt], GREEDY)
    assert tokens[0] == generated[0, len(prompt) :].tolist()
