"""Driving an LLMEngine to completion in tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdserve.workers.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def make_engine(
    model_dir: Path,
    budget: int = 512,
    chunked: bool = True,
    num_blocks: int = 256,
    max_num_seqs: int = 64,
    prefix_caching: bool = True,
) -> LLMEngine:
    """An engine on `model_dir` with the given scheduling and cache settings."""
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=chunked,
            ),
        )
    )


def run_to_completion(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams = GREEDY,
) -> tuple[list[list[int]], list[StepResult]]:
    """Add every prompt at once, step until all finish; tokens per prompt and the steps."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"req-{index}", prompt, params)
    tokens: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
    steps = []
    while engine.has_unfinished():
        result = engine.step()
        steps.append(result)
        for output in result.outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[f"req-{i}"] for i in range(len(prompts))], steps
