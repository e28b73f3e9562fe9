"""Workloads whose requests share prefixes exactly as planned: replay of traces in
the Mooncake format (JSON lines: `timestamp` in ms, `input_length`, `output_length`,
`hash_ids`: two requests whose lists start with the same k ids share their first k
blocks of 512 tokens), and a multi-turn chat with shared system prompts, described
the same way.

A request's prompt is text built from its block ids: the same id, the same words, so
prompts share exactly the prefixes the plan says, and any server, router or peer
that routes on text or on tokens sees the same sharing. A block is a run of words
each starting with a space; byte-level BPE splits text at those spaces, so the
tokens of a prompt are the tokens of its blocks one after the other, and a shared
block is a shared run of tokens. Lengths are scaled with `length_scale` (a block of
512 tokens becomes about 512 x scale), keeping whole blocks shared.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.workers.bench.records import RequestRecord
from pdserve.workers.bench.trace import TraceError, TraceScaling
from pdserve.workers.bench.workloads import clip_length

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' block
# Words of 2 to 4 letters: a byte-level BPE of a small vocabulary takes one or two
# tokens each (with its leading space); the mean is measured, not assumed.
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
_WORD_LETTERS = (2, 4)
TOKENS_PER_WORD = 1.5
MULTI_TURN = "multi-turn"
_GROUP_STREAM = 3  # the draw of prefix groups (plan.py's streams are 0 to 2)


@dataclass(frozen=True)
class PrefixRow:
    """One request: when it arrives, the blocks its prompt is made of, its lengths
    (input in trace tokens: the last block is cut to it)."""

    offset_s: float
    hash_ids: tuple[int, ...]
    input_tokens: int
    output_tokens: int


def is_prefix_trace(path: Path) -> bool:
    """Whether a trace file is in the Mooncake format (JSON lines)."""
    return path.suffix in (".jsonl", ".json")


def load_prefix_trace(path: Path) -> list[PrefixRow]:
    """Parse a Mooncake-format trace, offsets from the first arrival."""
    rows: list[PrefixRow] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise TraceError(f"cannot read trace {path}: {error.strerror or error}") from error
    for number, line in enumerate(lines, start=1):
        if line.strip():
            rows.append(_parse(path, number, line))
    if not rows:
        raise TraceError(f"{path}: no requests in the trace")
    rows.sort(key=lambda row: row.offset_s)
    first = rows[0].offset_s
    return [
        PrefixRow(r.offset_s - first, r.hash_ids, r.input_tokens, r.output_tokens) for r in rows
    ]


def _parse(path: Path, number: int, line: str) -> PrefixRow:
    try:
        raw = json.loads(line)
        ids = tuple(int(i) for i in raw["hash_ids"])
        row = PrefixRow(
            float(raw["timestamp"]) / 1000, ids, int(raw["input_length"]),
            int(raw["output_length"]),
        )  # fmt: skip
    except (ValueError, TypeError, KeyError) as error:
        raise TraceError(f"{path}:{number}: bad request {line[:80]!r}: {error}") from error
    if not ids or row.input_tokens <= 0 or row.output_tokens <= 0:
        raise TraceError(f"{path}:{number}: a request needs blocks and positive lengths")
    return row


def sample_prefix_groups(rows: Sequence[PrefixRow], share: float, seed: int) -> list[PrefixRow]:
    """The requests of a share of the trace's prefix groups (requests whose first block
    is the same), drawn from `seed`, with offsets from the first kept arrival.

    A trace's first requests rarely share anything (its reuse is between requests
    far apart); keeping whole groups over the whole trace keeps its reuse at a rate
    a small pool holds."""
    if not 0 < share <= 1:
        raise TraceError(f"the share of prefix groups must be in (0, 1], got {share}")
    firsts = sorted({row.hash_ids[0] for row in rows})
    drawn = np.random.default_rng([seed, _GROUP_STREAM]).random(len(firsts))
    kept = {first for first, draw in zip(firsts, drawn, strict=True) if draw < share}
    sampled = [row for row in rows if row.hash_ids[0] in kept]
    if not sampled:
        raise TraceError(f"no prefix group drawn at share {share}: raise it")
    start = sampled[0].offset_s
    return [dataclasses.replace(row, offset_s=row.offset_s - start) for row in sampled]


def scale_rows(rows: Sequence[PrefixRow], scaling: TraceScaling) -> list[PrefixRow]:
    """The rows as replayed: offsets and output lengths scaled and cut like any trace's
    (see `trace.scale_trace`); input lengths stay in trace tokens (blocks are scaled
    when prompts are built)."""
    if scaling.time_scale <= 0 or scaling.length_scale <= 0:
        raise TraceError("trace time and length scales must be positive")
    scaled: list[PrefixRow] = []
    for row in rows:
        offset = row.offset_s * scaling.time_scale
        if scaling.past_end(offset, len(scaled)):
            break
        output = clip_length(
            round(row.output_tokens * scaling.length_scale), scaling.max_output_tokens
        )
        scaled.append(PrefixRow(offset, row.hash_ids, row.input_tokens, output))
    return scaled


@dataclass(frozen=True)
class MultiTurnShape:
    """A chat service: conversations over a few shared system prompts, each turn's
    prompt the whole history (system prompt, every user message and answer) and a
    new user message, in trace blocks of 512 tokens."""

    system_prompts: int = 4
    system_blocks: int = 4
    turns: int = 5
    user_blocks: int = 1
    answer_blocks: int = 1
    think_s: float = 4.0  # between a conversation's turns
    output_tokens: int = 24


def multi_turn_rows(
    seed: int, rate: float, count: int, shape: MultiTurnShape = MultiTurnShape()
) -> list[PrefixRow]:
    """`count` requests of conversations starting at `rate` conversations per second
    (Poisson), sorted by arrival."""
    rng = np.random.default_rng([seed, 7])
    next_id = shape.system_prompts * shape.system_blocks
    rows: list[PrefixRow] = []
    start = 0.0
    conversation = 0
    while len(rows) < count:
        system = conversation % shape.system_prompts
        history = list(range(system * shape.system_blocks, (system + 1) * shape.system_blocks))
        for turn in range(shape.turns):
            history += range(next_id, next_id + shape.user_blocks)
            next_id += shape.user_blocks
            tokens = len(history) * TRACE_BLOCK_TOKENS
            rows.append(
                PrefixRow(start + turn * shape.think_s, tuple(history), tokens, shape.output_tokens)
            )
            history += range(next_id, next_id + shape.answer_blocks)
            next_id += shape.answer_blocks
        conversation += 1
        start += float(rng.exponential(1.0 / rate))
    rows.sort(key=lambda row: row.offset_s)
    return rows[:count]


def prompt_text(seed: int, row: PrefixRow, length_scale: float) -> str:
    """The prompt of a row: its blocks' words, the last block cut to the input length."""
    words = max(1, round(TRACE_BLOCK_TOKENS * length_scale / TOKENS_PER_WORD))
    last_tokens = row.input_tokens - (len(row.hash_ids) - 1) * TRACE_BLOCK_TOKENS
    last_share = min(1.0, max(0.0, last_tokens / TRACE_BLOCK_TOKENS))
    parts = [_block(seed, block_id, words) for block_id in row.hash_ids[:-1]]
    last = _block(seed, row.hash_ids[-1], words)
    parts.append(last[: max(1, round(len(last) * last_share))])
    return "".join(parts)


def _block(seed: int, block_id: int, words: int) -> str:
    rng = np.random.default_rng([seed, 11, block_id])
    lengths = rng.integers(_WORD_LETTERS[0], _WORD_LETTERS[1], words, endpoint=True)
    letters = rng.choice(_LETTERS, int(lengths.sum()))
    out, at = [], 0
    for length in lengths:
        out.append(" " + "".join(letters[at : at + length]))
        at += int(length)
    return "".join(out)


@dataclass(frozen=True)
class PrefixFigures:
    """Prefix reuse over a run: prompt tokens, those the engines found cached (their
    own count, from each answer's usage), and the bound: the tokens an earlier
    prompt had already (unlimited cache, perfect routing), when known."""

    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int | None = None

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def found_share(self) -> float | None:
        """Cached over reusable tokens: how much of the bound routing found."""
        if not self.reusable_tokens:
            return None
        return self.cached_tokens / self.reusable_tokens


def prefix_figures(records: Iterable[RequestRecord]) -> PrefixFigures | None:
    """Prompt and cached tokens of the requests whose answer reported both (None when
    none did: the server does not report cached tokens)."""
    reported = [
        (r.usage_prompt_tokens, r.usage_cached_tokens)
        for r in records
        if r.ok and r.usage_prompt_tokens is not None and r.usage_cached_tokens is not None
    ]
    if not reported:
        return None
    return PrefixFigures(sum(p for p, _ in reported), sum(c for _, c in reported))


def reusable_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> int:
    """The tokens of each prompt, in full blocks of `block_size`, that some earlier
    prompt began with (the engine leaves a prompt's last token to compute)."""
    from pdserve.workers.engine.kv_events import prefix_hashes

    seen: set[bytes] = set()
    total = 0
    for prompt in prompts:
        hashes = prefix_hashes(prompt, block_size)[: (len(prompt) - 1) // block_size]
        shared = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        total += shared * block_size
        seen.update(hashes)
    return total
