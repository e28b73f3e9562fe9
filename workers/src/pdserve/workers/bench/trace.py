"""Replay of request traces in the Azure LLM inference trace CSV format.

Columns: TIMESTAMP (e.g. `2023-11-16 18:15:46.6805900`), ContextTokens,
GeneratedTokens. Arrival offsets are relative to the earliest timestamp; a time
scale below one replays faster, and the length scale shrinks prompts and outputs
for a small machine while keeping the shape of the distribution.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pdserve.workers.bench.workloads import clip_length

_REQUIRED_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be read as a request trace."""


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: when it arrived and how long it was."""

    offset_s: float
    context_tokens: int
    generated_tokens: int


def load_trace(path: Path) -> list[TraceRow]:
    """Parse a trace CSV into rows sorted by arrival, offsets from the first arrival."""
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in _REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
            raw = [_parse_row(path, number, row) for number, row in enumerate(reader, start=2)]
    except OSError as error:
        raise TraceError(f"cannot read trace {path}: {error.strerror or error}") from error
    if not raw:
        raise TraceError(f"{path}: no requests in the trace")
    raw.sort(key=lambda item: item[0])
    first = raw[0][0]
    return [TraceRow((stamp - first).total_seconds(), ctx, gen) for stamp, ctx, gen in raw]


def _parse_row(path: Path, number: int, row: dict[str, str]) -> tuple[datetime, int, int]:
    try:
        # Python 3.11 accepts the trace's seven fractional digits (it keeps six).
        stamp = datetime.fromisoformat(row["TIMESTAMP"].strip())
        return stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])
    except (ValueError, TypeError) as error:
        raise TraceError(f"{path}:{number}: bad row {row}: {error}") from error


@dataclass(frozen=True)
class TraceScaling:
    """How a trace is replayed: time and length scales, limits and cut-offs."""

    time_scale: float = 1.0
    length_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    duration_s: float | None = None
    num_requests: int | None = None

    def past_end(self, offset_s: float, taken: int) -> bool:
        """Whether a request at `offset_s` (scaled), after `taken` others, is cut off."""
        if self.duration_s is not None and offset_s >= self.duration_s:
            return True
        return self.num_requests is not None and taken >= self.num_requests


def scale_trace(rows: list[TraceRow], scaling: TraceScaling) -> list[TraceRow]:
    """The rows as they will be replayed: rescaled, clipped and cut to duration/count."""
    if scaling.time_scale <= 0 or scaling.length_scale <= 0:
        raise TraceError("trace time and length scales must be positive")
    scaled: list[TraceRow] = []
    for row in rows:
        offset = row.offset_s * scaling.time_scale
        if scaling.past_end(offset, len(scaled)):
            break
        scaled.append(
            TraceRow(
                offset,
                _scaled(row.context_tokens, scaling.length_scale, scaling.max_input_tokens),
                _scaled(row.generated_tokens, scaling.length_scale, scaling.max_output_tokens),
            )
        )
    return scaled


def _scaled(tokens: int, scale: float, limit: int | None) -> int:
    return clip_length(round(tokens * scale), limit)
