"""Decode attention of one layer, grouped by context length against one call over
every stream padded to the longest context (the way before groups), on the tiny
model's shapes (8 heads of 32, 2 KV heads, one torch thread): 64 streams of 100
tokens with one of 2,700 beside them, 64 equal streams (one group: the same call),
and 64 spread evenly from 100 to 2,935 tokens. The two ways alternate round by round
in one process. Run with `make bench`, or
`pytest tests/bench/test_decode_attention.py -m slow -s`.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from pdserve.workers.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    group_decodes,
    paged_attention,
)
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 32, 16
ROUNDS = 12
BATCHES = {
    "64x100 + 1x2700": [100] * 64 + [2700],
    "64x100": [100] * 64,
    "64x1000": [1000] * 64,
    "64 from 100 to 2935": [100 + 45 * i for i in range(64)],
}


def one_padded_call(tables: list[list[int]], lens: list[int]) -> tuple[DecodeGroup, ...]:
    width = max(len(table) for table in tables)
    padded = [table + [0] * (width - len(table)) for table in tables]
    return (DecodeGroup(None, torch.tensor(padded), torch.tensor(lens)),)


def grouped_calls(tables: list[list[int]], lens: list[int]) -> tuple[DecodeGroup, ...]:
    return group_decodes(tables, lens, "cpu")


def test_decode_attention_by_group() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    rows: list[dict[str, object]] = []
    for label, lens in BATCHES.items():
        needed = [-(-length // BLOCK) for length in lens]
        kv_layer = torch.randn(sum(needed), 2, BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
        order = torch.randperm(sum(needed), generator=generator).tolist()
        tables = []
        for used in needed:
            tables.append(order[:used])
            order = order[used:]
        query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=generator)
        ways = {"padded": one_padded_call, "grouped": grouped_calls}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for index in range(ROUNDS + 1):
            for name in ways if index % 2 == 0 else list(ways)[::-1]:
                started = time.perf_counter()
                meta = AttentionMetadata(
                    torch.zeros(len(lens), dtype=torch.long),
                    torch.zeros(len(lens), dtype=torch.long),
                    len(lens),
                    ways[name](tables, lens),
                    (),
                )
                paged_attention(query, kv_layer, meta, HEAD_DIM**-0.5)
                if index:  # the first round warms up
                    times[name].append((time.perf_counter() - started) * 1e3)
        padded, grouped = (statistics.median(times[name]) for name in ways)
        groups = len(group_decodes(tables, lens, "cpu"))
        speedup = round(padded / grouped, 2)
        rows.append({"batch": label, "groups": groups, "padded ms": round(padded, 2),
                     "grouped ms": round(grouped, 2), "speedup": speedup})  # fmt: skip
    publish("decode_attention", rows, {"threads": 1, "rounds": ROUNDS})
    ragged = rows[0]
    assert isinstance(ragged["speedup"], float) and ragged["speedup"] > 3
