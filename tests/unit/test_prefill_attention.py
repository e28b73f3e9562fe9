"""Prefill attention over the paged cache equals causal attention computed plainly (in
float64, every query head over its KV head's keys up to its own position), whichever
way the chunk is computed: one masked call, or split into the cached keys and the
chunk's own merged by their log-sum-exp."""

from __future__ import annotations

import pytest
import torch

from pdserve.workers.engine import attention
from pdserve.workers.engine.attention import AttentionMetadata, PrefillSegment, paged_attention

BLOCK = 16


def plain_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    cached: int, scale: float) -> torch.Tensor:  # fmt: skip
    """query [n, heads, dim] at positions cached..cached+n-1 over keys/values
    [context, kv_heads, dim], causal, in float64."""
    num_queries, heads, _ = query.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dim]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, ctx]
    positions = torch.arange(keys.shape[0])
    visible = positions[None, :] <= torch.arange(cached, cached + num_queries)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def run_chunks(chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int,
               seed: int, query_scale: float = 1.0) -> None:  # fmt: skip
    """Each (cached, chunk) is a sequence whose chunk is computed in one batch, its blocks
    scattered over the cache in random order; every row must equal the plain result."""
    generator = torch.Generator().manual_seed(seed)
    contexts = [cached + chunk for cached, chunk in chunks]
    blocks_needed = [-(-context // BLOCK) for context in contexts]
    num_blocks = sum(blocks_needed) + 3
    kv_layer = torch.randn(num_blocks, 2, BLOCK, kv_heads, dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator)
    queries, segments, row = [], [], 0
    for (_, chunk), context, used in zip(chunks, contexts, blocks_needed, strict=True):
        table, order = order[:used], order[used:]
        queries.append(torch.randn(chunk, heads, dim, generator=generator) * query_scale)
        segments.append(PrefillSegment(row, row + chunk, context, table))
        row += chunk
    query = torch.cat(queries)
    meta = AttentionMetadata(
        slot_blocks=torch.zeros(row, dtype=torch.long),
        slot_offsets=torch.zeros(row, dtype=torch.long),
        num_decode_tokens=0,
        decode_groups=(),
        prefills=tuple(segments),
    )
    scale = dim**-0.5
    out = paged_attention(query, kv_layer, meta, scale)
    for (cached, _), segment in zip(chunks, segments, strict=True):
        positions = segment.block_table[:, None] * BLOCK + torch.arange(BLOCK)
        flat = kv_layer.transpose(1, 2).reshape(-1, 2, kv_heads, dim)
        kv = flat[positions.flatten()[: segment.context_len]]  # [context, 2, kvh, dim]
        rows = slice(segment.token_start, segment.token_end)
        expected = plain_attention(query[rows], kv[:, 0], kv[:, 1], cached, scale)
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=1e-4)


def test_a_chunk_over_a_long_cached_prefix_is_split_and_exact() -> None:
    cached, chunk = 9_000, 120
    assert cached >= attention.SPLIT_MIN_CACHED
    assert attention.SPLIT_MIN_CHUNK <= chunk <= attention.SPLIT_MAX_CHUNK
    run_chunks([(cached, chunk)], heads=4, kv_heads=2, dim=32, seed=0)


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_ragged_blocks_and_several_chunks_in_one_batch(seed: int) -> None:
    generator = torch.Generator().manual_seed(100 + seed)

    def pick(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=generator))

    kv_heads = (1, 2)[pick(0, 2)]
    heads = kv_heads * (1, 2, 4)[pick(0, 3)]
    dim = (8, 16, 32, 64)[pick(0, 4)]
    chunks = [
        (0, pick(2, 200)),  # a chunk at the start of its prompt: no cached keys
        (pick(4_096, 7_000), pick(2, 130)),  # long cached prefixes, ends off a block's edge
        (pick(4_096, 6_000), 1),  # one query over a long prefix: too few to split
        (pick(1, 2_000), pick(2, 600)),  # shorter prefixes: the one-call path
        (pick(1, 300), attention.SPLIT_MAX_CHUNK + pick(1, 50)),  # a chunk too long to split
    ]
    run_chunks(chunks, heads, kv_heads, dim, seed)


@pytest.mark.parametrize("query_scale", [0.01, 8.0])
def test_split_exact_when_either_part_dominates(
    query_scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large scores put almost all weight on a few keys, in the cached part or in the
    chunk; the merge must keep both limits exact, short prefixes included."""
    monkeypatch.setattr(attention, "SPLIT_MIN_CACHED", 1)
    monkeypatch.setattr(attention, "SPLIT_MIN_CHUNK", 1)
    chunks = [(1, 1), (3, 40), (700, 17), (2_048, 256), (31, 5)]
    run_chunks(chunks, heads=4, kv_heads=2, dim=32, seed=7, query_scale=query_scale)
