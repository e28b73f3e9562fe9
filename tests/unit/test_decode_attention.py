"""Decode attention over the paged cache, in groups by context length, equals both
attention computed plainly (in float64, each stream over its own context) and the one
call over every stream padded to the longest context, on ragged batches."""

from __future__ import annotations

import pytest
import torch

from pdserve.workers.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    group_decodes,
    paged_attention,
)

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 32


def meta_for(groups: tuple[DecodeGroup, ...], decodes: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_blocks=torch.zeros(decodes, dtype=torch.long),
        slot_offsets=torch.zeros(decodes, dtype=torch.long),
        num_decode_tokens=decodes,
        decode_groups=groups,
        prefills=(),
    )


def one_padded_call(tables: list[list[int]], lens: list[int]) -> tuple[DecodeGroup, ...]:
    """Every stream padded to the longest context, in one call."""
    width = max(len(table) for table in tables)
    padded = [table + [0] * (width - len(table)) for table in tables]
    return (DecodeGroup(None, torch.tensor(padded), torch.tensor(lens)),)


def check(lens: list[int], seed: int) -> tuple[DecodeGroup, ...]:
    """Decodes of these context lengths, their blocks scattered over the cache; the
    grouped result must equal the plain one and the one padded call's."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-length // BLOCK) for length in lens]
    num_blocks = sum(needed) + 3
    kv_layer = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, DIM, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for used in needed:
        tables.append(order[:used])
        order = order[used:]
    query = torch.randn(len(lens), HEADS, DIM, generator=generator)
    scale = DIM**-0.5
    groups = group_decodes(tables, lens, "cpu")
    out = paged_attention(query, kv_layer, meta_for(groups, len(lens)), scale)

    padded = paged_attention(
        query, kv_layer, meta_for(one_padded_call(tables, lens), len(lens)), scale
    )
    torch.testing.assert_close(out, padded, atol=1e-6, rtol=1e-5)
    flat = kv_layer.transpose(1, 2).reshape(-1, 2, KV_HEADS, DIM)  # [slot, 2, kvh, dim]
    for row, (table, length) in enumerate(zip(tables, lens, strict=True)):
        slots = (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length]
        kv = flat[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=2)  # [ctx, 2, h, d]
        scores = torch.einsum("hd,chd->hc", query[row].double(), kv[:, 0]) * scale
        expected = torch.einsum("hc,chd->hd", torch.softmax(scores, dim=-1), kv[:, 1])
        torch.testing.assert_close(out[row].double(), expected, atol=2e-5, rtol=1e-4)
    return groups


def test_one_long_stream_among_many_short_ones_is_attended_apart() -> None:
    lens = [100 + i for i in range(30)]
    lens.insert(7, 2_700)
    groups = check(lens, seed=0)
    assert len(groups) == 2
    widths = sorted(group.block_tables.shape[1] for group in groups)
    assert widths == [-(-129 // BLOCK), -(-2_700 // BLOCK)]


def test_equal_lengths_take_one_call_over_every_stream() -> None:
    groups = check([300] * 12, seed=1)
    assert len(groups) == 1 and groups[0].rows is None


def test_a_single_stream() -> None:
    assert len(check([37], seed=2)) == 1


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_lengths(seed: int) -> None:
    generator = torch.Generator().manual_seed(200 + seed)
    count = int(torch.randint(2, 40, (1,), generator=generator))
    lens = torch.randint(1, 3_000, (count,), generator=generator).tolist()
    groups = check(lens, seed=seed)
    rows = sorted(
        row
        for group in groups
        for row in (group.rows.tolist() if group.rows is not None else range(count))
    )
    assert rows == list(range(count))
