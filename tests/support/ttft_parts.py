"""Where each request's time to first token went, from the bench's records and the
decode workers' DEBUG logs (the step lines `pdserve.workers.plan.step_log` reads, and
the serving layer's "request ... is the client's ..." line, written when a request
reaches the worker):

    way in    sent, to the worker having it (the router: tokenization, block hashes,
              choice; the HTTP hops)
    queue     to the start of its first prompt step (waiting for the step under way,
              for a seat, for blocks, for prompts served before it)
    prefill   its prompt steps, to the end of the one that sampled its first token:
              how many, what they took, and what else they ran (other prompts'
              tokens, decodes)
    way out   to the client having the first token (worker, router, client)

A worker's request is matched to a bench record by its prompt's length (the last
prompt step ends at it) and, among requests of that length, the first that reached
a worker after the record was sent. Worker log times are wall-clock (the log line's
milliseconds); the records' are `time.perf_counter`, moved onto the wall clock by
`wall_offset` (taken in the bench's process).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.workers.plan.step_log import chunks_of, took_ms_of

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_ARRIVED = re.compile(r"serving: request (\S+) is the client's ")


@dataclass
class _Step:
    start: float
    end: float
    chunks: list[tuple[str, int, int]]


@dataclass
class WorkerRequest:
    """A request as one decode worker's log tells it."""

    worker: int
    arrived: float  # wall-clock seconds
    steps: list[tuple[_Step, int, int]] = field(default_factory=list)  # step, start, tokens

    def prompt_steps(self, prompt_tokens: int) -> list[tuple[_Step, int, int]]:
        """Its steps that computed its prompt's tokens, if the last of them reached the
        prompt's end at `prompt_tokens` (else none: not this request)."""
        steps = [(step, start, n) for step, start, n in self.steps if start < prompt_tokens]
        if not steps or steps[-1][1] + steps[-1][2] != prompt_tokens:
            return []
        return steps


def read_requests(logs: Iterable[Path]) -> list[WorkerRequest]:
    """Every request the decode workers' logs tell, with its steps."""
    found: list[WorkerRequest] = []
    for worker, log in enumerate(logs):
        by_id: dict[str, WorkerRequest] = {}
        chunks: list[tuple[str, int, int]] | None = None
        for line in log.read_text(errors="replace").splitlines():
            if arrived := _ARRIVED.search(line):
                by_id[arrived[1]] = WorkerRequest(worker, _wall(line))
            elif (listed := chunks_of(line)) is not None:
                chunks = listed
            elif (took_ms := took_ms_of(line)) is not None and chunks is not None:
                end = _wall(line)
                step = _Step(end - took_ms / 1000, end, chunks)
                for request, start, tokens in chunks:
                    if request in by_id:
                        by_id[request].steps.append((step, start, tokens))
                chunks = None
        found += [r for r in by_id.values() if r.steps]
    return found


def ttft_parts(
    records: list[dict[str, Any]], logs: Iterable[Path], wall_offset: float
) -> list[dict[str, Any]]:
    """Each record (`sent`: perf_counter seconds, `ttft_ms`, `prompt_tokens`) with its
    TTFT's parts in milliseconds, where a worker's log tells them (else unchanged)."""
    unmatched = sorted(read_requests(logs), key=lambda r: r.arrived)
    parted = []
    for record in records:
        sent, ttft_ms = record.get("sent"), record.get("ttft_ms")
        if sent is None or ttft_ms is None:
            parted.append(record)
            continue
        sent_wall = sent + wall_offset
        prompt = record.get("prompt_tokens") or 0
        match = next(
            (r for r in unmatched if r.arrived >= sent_wall - 0.01 and r.prompt_steps(prompt)),
            None,
        )
        if match is None:
            parted.append(record)
            continue
        unmatched.remove(match)
        steps = match.prompt_steps(prompt)
        first, last = steps[0][0], steps[-1][0]
        parted.append(
            record
            | {
                "worker": match.worker,
                "way_in_ms": (match.arrived - sent_wall) * 1000,
                "queue_ms": (first.start - match.arrived) * 1000,
                "prefill_ms": (last.end - first.start) * 1000,
                "prompt_steps_ms": [round((s.end - s.start) * 1000, 1) for s, _, _ in steps],
                "prompt_chunks": [tokens for _, _, tokens in steps],
                "other_prompt_tokens": [_others(s, tokens) for s, _, tokens in steps],
                "decodes_beside": [sum(1 for c in s.chunks if c[2] == 1) for s, _, _ in steps],
                "way_out_ms": ttft_ms - (last.end - sent_wall) * 1000,
            }
        )
    return parted


def _others(step: _Step, own: int) -> int:
    return sum(tokens for _, _, tokens in step.chunks if tokens > 1) - (own if own > 1 else 0)


def _wall(line: str) -> float:
    stamp = _STAMP.match(line)
    if stamp is None:
        raise ValueError(f"no time stamp: {line[:40]!r}")
    return datetime.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
