"""What the engine reports about itself: plain objects, turned into metrics elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.workers.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.workers.engine.request import FinishReason
from pdserve.workers.engine.step_cost import StepCostEstimate


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one choice of a request (a request with n = 1 has
    one choice, index 0)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool  # the request ended: every choice did
    finish_reason: FinishReason | None  # this choice's, once it ended
    num_prompt_tokens: int
    num_output_tokens: int  # of this choice
    num_cached_tokens: int
    time: float  # time.monotonic() when the step ended
    index: int = 0
    # One per new token, when the request asked for log-probabilities.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # The prompt's, on each choice's first output, when asked for.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class StepStats:
    """One engine step."""

    time: float  # time.monotonic() when the step ended
    duration_s: float
    num_tokens: int  # tokens computed in the step
    num_decode_tokens: int
    num_prefill_chunks: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_preemptions: int  # preemptions in this step
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int  # of which found
    leases_expired_total: int  # hand-off leases that ran out, since start
    kv_blocks_allocated_total: int = 0  # KV blocks handed out, since start
    token_budget: int = 0  # tokens the step was allowed to compute
    predicted_duration_s: float = 0.0  # the step-cost model's prediction for this step
    # The step's decodes waited longer than the ITL target for its tokens (since the
    # previous step ended: the gap between tokens a client sees, less the network).
    over_target: bool = False
    step_cost: StepCostEstimate | None = None  # what the step-cost model believes now


@dataclass(frozen=True)
class FinishedRequest:
    """Timing and sizes of a request that ended."""

    request_id: str
    arrival_time: float
    first_scheduled_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: FinishReason
