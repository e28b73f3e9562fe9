"""The plan of a run: which request is sent when, and how long it is.

Every random draw comes from the run's seed, on separate streams for arrivals,
lengths and prompt contents, so that changing the rate does not change the
lengths, and a request's prompt depends only on the seed and its index (prompts
are made when sent, not held in memory for the whole run).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.workers.bench.arrivals import arrival_offsets
from pdserve.workers.bench.config import FIRST_PROMPT_TOKEN_ID, BenchConfig
from pdserve.workers.bench.prefix_workloads import (
    MULTI_TURN,
    MultiTurnShape,
    PrefixRow,
    is_prefix_trace,
    load_prefix_trace,
    multi_turn_rows,
    prompt_text,
    sample_prefix_groups,
    scale_rows,
)
from pdserve.workers.bench.trace import TraceScaling, load_trace, scale_trace
from pdserve.workers.bench.workloads import workload_named

_ARRIVAL_STREAM = 0
_LENGTH_STREAM = 1
_PROMPT_STREAM = 2


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send: its offset from the start and its lengths in tokens."""

    index: int
    offset_s: float
    input_tokens: int
    output_tokens: int
    kind: str
    prefix: PrefixRow | None = None  # the blocks its prompt text is made of (see prefix_workloads)


def build_plan(config: BenchConfig) -> list[PlannedRequest]:
    """The requests of the run, in arrival order."""
    if config.trace is not None and is_prefix_trace(config.trace):
        rows = load_prefix_trace(config.trace)
        if config.trace_prefix_share is not None:
            rows = sample_prefix_groups(rows, config.trace_prefix_share, config.seed)
        return _prefix_plan(scale_rows(rows, _trace_scaling(config)), "trace")
    if config.trace is not None:
        return _trace_plan(config)
    if config.workload == MULTI_TURN:
        shape = MultiTurnShape()
        horizon = config.horizon_s or 60.0
        count = config.num_requests or max(1, round(config.rate * horizon * shape.turns))
        return _prefix_plan(multi_turn_rows(config.seed, config.rate, count, shape), MULTI_TURN)
    return _workload_plan(config)


def _prefix_plan(rows: list[PrefixRow], kind: str) -> list[PlannedRequest]:
    return [
        PlannedRequest(i, row.offset_s, row.input_tokens, row.output_tokens, kind, row)
        for i, row in enumerate(rows)
    ]


def _trace_scaling(config: BenchConfig) -> TraceScaling:
    return TraceScaling(
        time_scale=config.trace_time_scale,
        length_scale=config.trace_length_scale,
        max_input_tokens=config.max_input_tokens,
        max_output_tokens=config.max_output_tokens,
        duration_s=config.horizon_s,
        num_requests=config.num_requests,
    )


def _workload_plan(config: BenchConfig) -> list[PlannedRequest]:
    assert config.workload is not None
    workload = workload_named(config.workload, config.long_share)
    offsets = arrival_offsets(
        np.random.default_rng([config.seed, _ARRIVAL_STREAM]),
        config.rate,
        config.arrival,
        config.burstiness,
        count=config.num_requests,
        horizon_s=config.horizon_s,
    )
    lengths = np.random.default_rng([config.seed, _LENGTH_STREAM])
    plan: list[PlannedRequest] = []
    for index, offset in enumerate(offsets):
        kind, input_tokens, output_tokens = workload.sample(
            lengths, config.max_input_tokens, config.max_output_tokens
        )
        plan.append(PlannedRequest(index, offset, input_tokens, output_tokens, kind))
    return plan


def _trace_plan(config: BenchConfig) -> list[PlannedRequest]:
    assert config.trace is not None
    rows = scale_trace(load_trace(config.trace), _trace_scaling(config))
    return [
        PlannedRequest(i, row.offset_s, row.context_tokens, row.generated_tokens, "trace")
        for i, row in enumerate(rows)
    ]


def planned_prompt(config: BenchConfig, planned: PlannedRequest) -> list[int] | str:
    """The prompt a planned request sends: text made of its blocks, or token ids."""
    if planned.prefix is not None:
        return prompt_text(config.seed, planned.prefix, config.trace_length_scale)
    return prompt_tokens(config.seed, planned.index, planned.input_tokens, config.vocab_size)


def prompt_tokens(seed: int, index: int, length: int, vocab_size: int) -> list[int]:
    """The prompt of request `index`: `length` random token ids, reproducible from the seed.

    Ids are uniform over [FIRST_PROMPT_TOKEN_ID, vocab_size), so two prompts share a
    prefix only by chance (about vocab^-n for n tokens): no accidental prefix-cache hits.
    """
    rng = np.random.default_rng([seed, _PROMPT_STREAM, index])
    ids: list[int] = rng.integers(FIRST_PROMPT_TOKEN_ID, vocab_size, length).tolist()
    return ids
