"""Driving an LLMEngine to completion in tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.logprobs import LogprobsMode
from pdserve.workers.engine.stats import RequestOutput

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def make_engine(
    model_dir: Path,
    budget: int = 512,
    chunked: bool = True,
    num_blocks: int = 256,
    max_num_seqs: int = 64,
    prefix_caching: bool = True,
    logprobs_mode: LogprobsMode = "raw_logprobs",
) -> LLMEngine:
    """An engine on `model_dir` with the given scheduling and cache settings."""
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            logprobs_mode=logprobs_mode,
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


def run_outputs(
    engine: LLMEngine, requests: dict[str, tuple[Sequence[int], SamplingParams]]
) -> tuple[dict[str, list[RequestOutput]], list[StepResult]]:
    """Add every request at once, step until all finish; each request's outputs (of
    every choice, in order) and the steps."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in requests}
    steps = []
    while engine.has_unfinished():
        result = engine.step()
        steps.append(result)
        for output in result.outputs:
            outputs[output.request_id].append(output)
    return outputs, steps


def choice_tokens(outputs: Sequence[RequestOutput], n: int) -> list[list[int]]:
    """The tokens of each of a request's `n` choices."""
    tokens: list[list[int]] = [[] for _ in range(n)]
    for output in outputs:
        tokens[output.index].extend(output.new_token_ids)
    return tokens
