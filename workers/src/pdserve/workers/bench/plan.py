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


def build_plan(config: BenchConfig) -> list[PlannedRequest]:
    """The requests of the run, in arrival order."""
    if config.trace is not None:
        return _trace_plan(config)
    return _workload_plan(config)


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
    scaling = TraceScaling(
        time_scale=config.trace_time_scale,
        length_scale=config.trace_length_scale,
        max_input_tokens=config.max_input_tokens,
        max_output_tokens=config.max_output_tokens,
        duration_s=config.horizon_s,
        num_requests=config.num_requests,
    )
    rows = scale_trace(load_trace(config.trace), scaling)
    return [
        PlannedRequest(i, row.offset_s, row.context_tokens, row.generated_tokens, "trace")
        for i, row in enumerate(rows)
    ]


def prompt_tokens(seed: int, index: int, length: int, vocab_size: int) -> list[int]:
    """The prompt of request `index`: `length` random token ids, reproducible from the seed.

    Ids are uniform over [FIRST_PROMPT_TOKEN_ID, vocab_size), so two prompts share a
    prefix only by chance (about vocab^-n for n tokens): no accidental prefix-cache hits.
    """
    rng = np.random.default_rng([seed, _PROMPT_STREAM, index])
    ids: list[int] = rng.integers(FIRST_PROMPT_TOKEN_ID, vocab_size, length).tolist()
    return ids
