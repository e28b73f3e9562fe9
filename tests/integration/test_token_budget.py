"""The adaptive token budget in a real engine and a real worker: it changes how steps
are cut, never what they compute, and its metrics say what it did."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    TokenBudgetConfig,
)
from pdserve.workers.engine.engine import LLMEngine, StepResult
from support.engine import GREEDY, make_engine, run_to_completion
from support.worker import ServerProcess, metric, running_worker

FLOOR = 16
# Below any real step's time: every step with decodes running gets only the floor of
# prefill, on any machine, so the scheduling surely differs from the static budget.
UNREACHABLE_TARGET_S = 1e-6


def adaptive_engine(model_dir: Path) -> LLMEngine:
    budget = TokenBudgetConfig("adaptive", UNREACHABLE_TARGET_S, min_budget=FLOOR)
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            cache=CacheConfig(num_blocks=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, token_budget=budget),
        )
    )


def prompts() -> list[list[int]]:
    """Short prompts that soon decode, and long ones whose prefill runs beside them."""
    lengths = [12, 400, 30, 700, 5, 250]
    return [[3 + (7 * i + 13 * n) % 1000 for i in range(n)] for n in lengths]


def squeezed(steps: list[StepResult]) -> list[StepResult]:
    """Steps that ran decodes and prefill with only the floor of prefill tokens."""
    return [
        s
        for s in steps
        if s.stats.num_decode_tokens
        and s.stats.num_prefill_chunks
        and s.stats.token_budget == s.stats.num_decode_tokens + FLOOR
    ]


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)],
    ids=["greedy", "seeded-sampling"],
)
def test_adaptive_budget_gives_token_identical_outputs(
    small_model_dir: Path, params: SamplingParams
) -> None:
    static, static_steps = run_to_completion(
        make_engine(small_model_dir, budget=512), prompts(), params
    )
    adaptive, adaptive_steps = run_to_completion(
        adaptive_engine(small_model_dir), prompts(), params
    )
    assert adaptive == static
    # The budget really changed the scheduling: prefill was cut to the floor while
    # streams ran, so the same work took more steps.
    assert squeezed(adaptive_steps) and not squeezed(static_steps)
    assert len(adaptive_steps) > len(static_steps)


@pytest.fixture(scope="module")
def adaptive_worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ("--token-budget", "adaptive", "--target-itl-ms", str(UNREACHABLE_TARGET_S * 1000),
            "--min-budget", str(FLOOR), "--max-num-batched-tokens", "512",
            "--served-model-name", "small")  # fmt: skip
    with running_worker(small_model_dir, tmp_path_factory.mktemp("logs"), *args) as process:
        yield process


def test_adaptive_worker_reports_its_budget_and_overruns(adaptive_worker: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{adaptive_worker.url}/v1", api_key="unused", max_retries=0)
    streaming = client.completions.create(
        model="small", prompt="a stream that runs until it is closed", max_tokens=900,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first, stop = threading.Event(), threading.Event()

    def consume() -> None:
        for _ in streaming:
            first.set()
            if stop.is_set():
                break
        streaming.close()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert first.wait(timeout=60)
    # A long prompt arrives while the stream decodes; the stream stays open until the
    # prompt is done, so the two overlap whatever the machine's speed.
    long_prompt = [3 + i % 500 for i in range(300)]
    done = client.completions.create(
        model="small", prompt=long_prompt, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 2
    stop.set()
    reader.join(timeout=60)

    # The prompt ran in floor-sized chunks beside the stream (bucket: at most 32 tokens).
    budgets = metric(adaptive_worker, "pdserve_engine_token_budget_bucket", le="32.0")
    assert budgets >= 300 // FLOOR - 1
    assert metric(adaptive_worker, "pdserve_engine_steps_over_target_total") > 0
    predicted = metric(adaptive_worker, "pdserve_engine_step_predicted_duration_seconds_count")
    assert predicted == metric(adaptive_worker, "pdserve_engine_step_duration_seconds_count")
    assert metric(adaptive_worker, "pdserve_engine_step_cost_base_seconds") >= 0
    learned = [
        metric(adaptive_worker, f"pdserve_engine_step_cost_{term}_seconds")
        for term in ("base", "per_decode_token", "per_prefill_token")
    ]
    assert sum(learned) > 0
