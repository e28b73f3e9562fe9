"""The configuration of one benchmark run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.workers.bench.arrivals import ARRIVAL_PROCESSES, ArrivalProcess
from pdserve.workers.bench.metrics import DEFAULT_BUCKETS, SLO
from pdserve.workers.bench.prefix_workloads import MULTI_TURN, is_prefix_trace
from pdserve.workers.bench.workloads import WORKLOADS

DEFAULT_RATE = 2.0
DEFAULT_DURATION_S = 60.0
DEFAULT_DRAIN_TIMEOUT_S = 60.0
DEFAULT_VOCAB_SIZE = 256
# Token ids below this are left out of prompts: small models reserve them for
# padding, beginning and end of sequence.
FIRST_PROMPT_TOKEN_ID = 3


class ConfigError(ValueError):
    """A benchmark configuration that cannot run."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines a run: target, traffic, limits and SLOs.

    Exactly one of `workload` and `trace` is set. With neither `duration_s` nor
    `num_requests`, a run lasts `DEFAULT_DURATION_S`.
    """

    url: str
    workload: str | None = None
    long_share: float | None = None  # mixed: share of long prompts (default 0.15)
    trace: Path | None = None
    model: str | None = None
    rate: float = DEFAULT_RATE
    arrival: ArrivalProcess = "poisson"
    burstiness: float = 1.0
    duration_s: float | None = None
    num_requests: int | None = None
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    vocab_size: int = DEFAULT_VOCAB_SIZE
    trace_time_scale: float = 1.0
    trace_length_scale: float = 1.0
    # A prefix trace: replay the requests of this share of its prefix groups only.
    trace_prefix_share: float | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    concurrency_limit: int | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    # Prompts sent as text, decoded with this tokenizer (a checkpoint directory), for
    # servers that take no token ids; and whether requests ask to ignore EOS (servers
    # that do not know the field refuse it).
    text_prompts: Path | None = None
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        for problem in self._problems():
            raise ConfigError(problem)

    def _problems(self) -> list[str]:
        problems: list[str] = []
        if self.long_share is not None and (
            self.workload != "mixed" or not 0.0 <= self.long_share <= 1.0
        ):
            problems.append("long-share applies to the mixed workload and must be in [0, 1]")
        if (self.workload is None) == (self.trace is None):
            problems.append("give exactly one of a workload and a trace")
        if self.trace_prefix_share is not None and not (
            self.trace is not None and is_prefix_trace(self.trace)
            and 0 < self.trace_prefix_share <= 1
        ):  # fmt: skip
            problems.append("trace-prefix-share applies to a prefix trace and must be in (0, 1]")
        if self.workload is not None and self.workload not in (*WORKLOADS, MULTI_TURN):
            problems.append(f"unknown workload {self.workload!r}; known: {', '.join(WORKLOADS)}")
        if self.arrival not in ARRIVAL_PROCESSES:
            problems.append(f"unknown arrival process {self.arrival!r}")
        if not self.rate > 0:
            problems.append(f"rate must be positive, got {self.rate}")
        if math.isinf(self.rate) and self.num_requests is None and self.trace is None:
            problems.append("an infinite rate needs --num-requests")
        if self.arrival == "poisson" and self.burstiness != 1.0:
            problems.append("burstiness applies to gamma arrivals (--arrival gamma)")
        positive = {
            "burstiness": self.burstiness,
            "duration": self.duration_s,
            "num-requests": self.num_requests,
            "trace-time-scale": self.trace_time_scale,
            "trace-length-scale": self.trace_length_scale,
            "max-input-tokens": self.max_input_tokens,
            "max-output-tokens": self.max_output_tokens,
            "concurrency-limit": self.concurrency_limit,
            "drain-timeout": self.drain_timeout_s,
        }
        problems += [
            f"{name} must be positive" for name, v in positive.items() if v is not None and v <= 0
        ]
        if self.vocab_size <= FIRST_PROMPT_TOKEN_ID:
            problems.append(f"vocab size must be above {FIRST_PROMPT_TOKEN_ID}")
        return problems

    @property
    def horizon_s(self) -> float | None:
        """How long requests keep being sent (None: until the request count is reached)."""
        if self.duration_s is None and self.num_requests is None:
            return DEFAULT_DURATION_S
        return self.duration_s

    @property
    def source(self) -> str:
        """The traffic, in words: the workload name or the trace file name."""
        return self.workload if self.workload is not None else f"trace {self.trace}"
