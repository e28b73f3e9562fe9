"""A worker's steps as its engine's DEBUG step logs tell them, and the prompt steps'
compute over the step-cost model's.

The profile's pair turns on two loggers in its workers, and only those
(`pdserve.workers.engine.steps`: the chunks a step ran; `...step_timing`: what it
took), through a `sitecustomize` put on their PYTHONPATH: the worker's own
`--log-level` stays as a pool's is. From the decode worker's lines the pair reads
what each step carrying a prompt's chunk took, which is what a pool's prompt steps
are measured by, rather than what a stream saw of it (a stream's gap also holds the
server answering the prompt and the clients' reading, and caught whichever step was
the longest in its window)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.workers.engine.step_cost import StepFeatures
from pdserve.workers.plan.costs import StepCost

STEP_LOGGERS = ("pdserve.workers.engine.steps", "pdserve.workers.engine.step_timing")
_SITECUSTOMIZE = (
    '"""Turns on the engine\'s per-step DEBUG logs, and nothing else."""\n'
    "import logging\n\n"
    f"for name in {STEP_LOGGERS!r}:\n"
    "    logging.getLogger(name).setLevel(logging.DEBUG)\n"
)
_CHUNKS = re.compile(r"engine\.steps: step (?P<chunks>.*)$")
_TIMING = re.compile(r"engine\.step_timing: .* took=(?P<took>[\d.]+)ms")
_SINCE = re.compile(r" since_last_tokens=(?P<since>[\d.]+)ms")
_CHUNK = re.compile(r"^(?P<request>.+)@(?P<start>\d+)\+(?P<tokens>\d+)$")


@dataclass(frozen=True)
class LoggedStep:
    """One step a worker logged: its chunks as (start, tokens) spans, what it took, and
    the time from the previous step's tokens to its own (the worker's cadence: the step
    and what serving did between the two; None where the line does not tell it)."""

    spans: tuple[tuple[int, int], ...]
    took_s: float
    interval_s: float | None = None

    @property
    def features(self) -> StepFeatures:
        """The step in the step-cost model's terms."""
        return StepFeatures.of_spans(self.spans)

    @property
    def longest_chunk(self) -> int:
        """The tokens of its longest chunk (1: decodes only)."""
        return max((tokens for _, tokens in self.spans), default=0)


def step_logging_env(directory: Path) -> dict[str, str]:
    """The environment that turns a worker's per-step logs on; the module that does
    it is written under `directory`."""
    home = directory / "step-logging"
    home.mkdir(parents=True, exist_ok=True)
    (home / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return {"PYTHONPATH": str(home)}


def chunks_of(line: str) -> list[tuple[str, int, int]] | None:
    """The (request, start, tokens) chunks a step's chunks line lists; None for any
    other line."""
    found = _CHUNKS.search(line)
    if found is None:
        return None
    return [
        (chunk["request"], int(chunk["start"]), int(chunk["tokens"]))
        for part in found["chunks"].split()
        if (chunk := _CHUNK.match(part))
    ]


def took_ms_of(line: str) -> float | None:
    """The milliseconds a step's timing line says it took; None for any other line."""
    timed = _TIMING.search(line)
    return None if timed is None else float(timed["took"])


def is_warm_up(chunks: Sequence[tuple[str, int, int]]) -> bool:
    """Whether a step ran the worker's warm-up (not a request's work)."""
    return any(request.startswith("warm-up") for request, _, _ in chunks)


def read_steps(text: str) -> list[LoggedStep]:
    """The steps a worker's log text tells, in order (warm-up steps left out; a timing
    line without its chunks' line before it, as at the start of a slice of a log, too)."""
    steps: list[LoggedStep] = []
    chunks: list[tuple[str, int, int]] | None = None
    for line in text.splitlines():
        if (listed := chunks_of(line)) is not None:
            chunks = listed
        elif (took_ms := took_ms_of(line)) is not None and chunks is not None:
            if chunks and not is_warm_up(chunks):
                spans = tuple((start, tokens) for _, start, tokens in chunks)
                since = _SINCE.search(line)
                interval_s = None if since is None else float(since["since"]) / 1e3
                steps.append(LoggedStep(spans, took_ms / 1e3, interval_s))
            chunks = None
    return steps


def prompt_step_samples(
    steps: Sequence[LoggedStep],
    cost: StepCost,
    least_chunk: int,
    every_step_s: float | None = None,
) -> tuple[tuple[int, float], ...]:
    """(prompt tokens, compute over the model's) of each step that ran a chunk of at
    least `least_chunk` tokens. A step's compute is what it took less what every step
    takes beyond the model (`every_step_s`; by default what the decode-only steps
    among `steps` took beyond it, their median): the serving overhead, measured from
    decode-only steps' gaps, already charges that part to each step."""
    if every_step_s is None:
        every_step_s = decode_steps_beyond(steps, cost)
    samples = []
    for step in steps:
        if step.longest_chunk >= least_chunk:
            features = step.features
            compute = step.took_s - every_step_s
            samples.append((features.prefill_tokens, compute / cost.seconds(features)))
    return tuple(samples)


def decode_steps_beyond(steps: Sequence[LoggedStep], cost: StepCost) -> float:
    """The median of what the decode-only steps among `steps` took beyond the
    step-cost model's compute (0: none among them)."""
    beyond = [
        step.took_s - cost.seconds(step.features) for step in steps if step.longest_chunk == 1
    ]
    return statistics.median(beyond) if beyond else 0.0


def cadence_beyond(steps: Sequence[LoggedStep], decodes: int, cost: StepCost) -> float | None:
    """What a serving worker's steps of `decodes` streams took beyond the step-cost
    model's compute, as its own clock tells it: the median, over its decode-only steps
    of exactly that many decodes, of the time from the previous step's tokens to the
    step's own (the cadence its streams see) less the model's compute of the step.
    None: no such step logged its cadence.

    The worker's clock, not the streams': a client's gaps also hold its own threads'
    reading (one stream's late read is the next one's short gap), and a batch filling
    up or running out is not the batch; here only the steps that ran it count."""
    beyond = [
        step.interval_s - cost.seconds(step.features)
        for step in steps
        if step.interval_s is not None and step.longest_chunk == 1 and len(step.spans) == decodes
    ]
    return statistics.median(beyond) if beyond else None


def read_steps_from(log: Path, offset: int) -> list[LoggedStep]:
    """The steps a worker's log at `log` tells from byte `offset` on."""
    with log.open("rb") as file:
        file.seek(offset)
        return read_steps(file.read().decode(errors="replace"))
