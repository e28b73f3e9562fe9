"""Log-probabilities from the engine against Hugging Face transformers: the prompt's
(the scoring that evaluation harnesses do with echo and max_tokens 0) and the sampled
tokens', raw and processed, chunked and preempted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.logprobs import TokenLogprob
from pdserve.workers.engine.stats import RequestOutput
from support.engine import make_engine, run_outputs
from support.scoring import LOGPROB_ATOL, reference_logprobs, reference_model

PROMPT_LEN = 200
TOP = 5


@pytest.fixture(scope="module")
def reference(small_model_dir: Path) -> torch.nn.Module:
    model: torch.nn.Module = reference_model(small_model_dir)
    return model


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(3, 1000, (PROMPT_LEN,), generator=generator).tolist()


def assert_matches(entry: TokenLogprob, expected_row: torch.Tensor, token: int) -> None:
    """One position: the token's log-probability and rank, and the top alternatives."""
    assert entry.token_id == token
    assert abs(entry.logprob - expected_row[token].item()) < LOGPROB_ATOL
    assert entry.rank == int((expected_row > expected_row[token]).sum()) + 1
    values, ids = expected_row.topk(len(entry.top))
    assert [token_id for token_id, _ in entry.top] == ids.tolist()
    assert max(abs(v - e) for (_, v), e in zip(entry.top, values.tolist(), strict=True)) < (
        LOGPROB_ATOL
    )


def scoring(top: int = TOP) -> SamplingParams:
    """Pure scoring: the prompt's log-probabilities, nothing sampled."""
    return SamplingParams(max_tokens=0, prompt_logprobs=top)


def only(outputs: list[RequestOutput]) -> RequestOutput:
    assert len(outputs) == 1
    return outputs[0]


@pytest.mark.parametrize("budget", [16, 37, 512])
def test_prompt_logprobs_equal_transformers_log_softmax(
    small_model_dir: Path, reference: torch.nn.Module, prompt: list[int], budget: int
) -> None:
    expected = reference_logprobs(reference, prompt)
    engine = make_engine(small_model_dir, budget=budget)
    outputs, steps = run_outputs(engine, {"score": (prompt, scoring())})
    output = only(outputs["score"])
    assert output.finished and output.new_token_ids == () and output.num_output_tokens == 0
    assert output.finish_reason is not None and output.finish_reason.value == "length"
    reported = output.prompt_logprobs
    assert reported is not None and len(reported) == PROMPT_LEN and reported[0] is None
    for position in range(1, PROMPT_LEN):
        entry = reported[position]
        assert entry is not None
        assert_matches(entry, expected[position - 1], prompt[position])
    # Chunked as scheduled, the prompt computed once, nothing left behind.
    assert sum(1 for step in steps if step.stats.num_prefill_chunks) == -(-PROMPT_LEN // budget)
    assert engine.kv_cache.pool.usage == 0.0


def test_a_continuation_scores_its_log_likelihood(
    small_model_dir: Path, reference: torch.nn.Module, prompt: list[int]
) -> None:
    context, continuation = prompt[:150], prompt[150:]
    expected = reference_logprobs(reference, prompt)
    likelihood = sum(
        expected[len(context) + i - 1, token].item() for i, token in enumerate(continuation)
    )
    engine = make_engine(small_model_dir, budget=64)
    outputs, _ = run_outputs(engine, {"score": (prompt, scoring(top=0))})
    reported = only(outputs["score"]).prompt_logprobs
    assert reported is not None
    scored = [entry.logprob for entry in reported[len(context) :] if entry is not None]
    assert len(scored) == len(continuation)
    assert abs(sum(scored) - likelihood) < LOGPROB_ATOL * len(continuation)


def test_sampled_tokens_carry_their_logprobs(
    small_model_dir: Path, reference: torch.nn.Module, prompt: list[int]
) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=TOP)
    outputs, _ = run_outputs(make_engine(small_model_dir, budget=64), {"g": (prompt, params)})
    tokens = [token for output in outputs["g"] for token in output.new_token_ids]
    entries = [entry for output in outputs["g"] for entry in output.logprobs or ()]
    assert len(entries) == len(tokens) == 8
    expected = reference_logprobs(reference, prompt + tokens)
    for offset, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        assert_matches(entry, expected[PROMPT_LEN - 1 + offset], token)
        assert entry.rank == 1  # greedy: the most likely token
    assert all(output.prompt_logprobs is None for output in outputs["g"])


def test_processed_logprobs_are_the_sampled_distribution(
    small_model_dir: Path, reference: torch.nn.Module, prompt: list[int]
) -> None:
    params = SamplingParams(
        max_tokens=4, temperature=0.5, top_k=3, seed=5, ignore_eos=True, logprobs=TOP
    )
    engine = make_engine(small_model_dir, budget=64, logprobs_mode="processed_logprobs")
    outputs, _ = run_outputs(engine, {"s": (prompt, params)})
    tokens = [token for output in outputs["s"] for token in output.new_token_ids]
    entries = [entry for output in outputs["s"] for entry in output.logprobs or ()]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    for offset, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        row = logits[PROMPT_LEN - 1 + offset] / 0.5
        kth = row.topk(3).values[-1]
        expected = torch.log_softmax(row.masked_fill(row < kth, float("-inf")), dim=-1)
        assert abs(entry.logprob - expected[token].item()) < LOGPROB_ATOL
        # Beyond the top 3 the sampler cannot draw: -inf.
        assert [value for _, value in entry.top][3:] == [float("-inf")] * (TOP - 3)
        assert entry.rank <= 3


def test_a_preempted_prompt_reports_its_logprobs_once(
    small_model_dir: Path, reference: torch.nn.Module, prompt: list[int]
) -> None:
    # 16 blocks of 16 tokens: the first request's decode outgrows what is left once
    # the scored prompt holds its blocks, so the later arrival (the prompt) is
    # preempted mid-way and computed again.
    engine = make_engine(small_model_dir, budget=32, num_blocks=16)
    first = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    outputs, steps = run_outputs(
        engine, {"long": (prompt[:100], first), "score": (prompt, scoring())}
    )
    assert sum(step.stats.num_preemptions for step in steps) >= 1
    reported = only(outputs["score"]).prompt_logprobs
    expected = reference_logprobs(reference, prompt)
    assert reported is not None and len(reported) == PROMPT_LEN
    for position in range(1, PROMPT_LEN):
        entry = reported[position]
        assert entry is not None
        assert_matches(entry, expected[position - 1], prompt[position])


def test_prompt_logprobs_skip_the_prefix_cache(small_model_dir: Path, prompt: list[int]) -> None:
    engine = make_engine(small_model_dir, budget=512)
    run_outputs(engine, {"warm": (prompt, SamplingParams(max_tokens=1))})
    outputs, steps = run_outputs(engine, {"score": (prompt, scoring())})
    assert only(outputs["score"]).num_cached_tokens == 0
    assert steps[0].stats.num_tokens == PROMPT_LEN
    assert steps[0].stats.prefix_cache_queries == 0
