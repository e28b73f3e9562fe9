"""Attention over the paged KV cache.

The cache of one layer is a tensor [num_blocks, 2, block_size, num_kv_heads, head_dim]:
each block holds its K and V side by side, so a block is one contiguous run of
memory per layer (a KV transfer moves a few large runs, not many small pieces).

A batch is flattened into one token axis: decode tokens first (one per sequence,
attended to in one padded batched call), then prefill chunks (one call each, with a
causal mask offset by the tokens already in the cache). The same code runs on CPU and
CUDA; scaled_dot_product_attention picks the fused kernel of the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSegment:
    """One prefill chunk in the flattened batch."""

    token_start: int  # first row of the chunk in the batch
    token_end: int  # one past its last row
    context_len: int  # tokens in the cache once this chunk is written (chunk included)
    block_table: torch.Tensor  # [num_blocks_of_seq] long


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to."""

    slot_blocks: torch.Tensor  # [T] block id receiving each token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decodes
    decode_block_tables: torch.Tensor  # [D, max_blocks] long, padded with 0
    decode_context_lens: torch.Tensor  # [D] long, tokens in cache incl. the new one
    prefills: tuple[PrefillSegment, ...]


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the new tokens' K and V ([T, kv_heads, head_dim]) in their slots."""
    kv_layer[meta.slot_blocks, 0, meta.slot_offsets] = key.to(kv_layer.dtype)
    kv_layer[meta.slot_blocks, 1, meta.slot_offsets] = value.to(kv_layer.dtype)


def paged_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of every query row ([T, heads, head_dim]) over its sequence's cache."""
    out = torch.empty_like(query)
    decodes = meta.num_decode_tokens
    if decodes:
        out[:decodes] = _decode_attention(query[:decodes], kv_layer, meta, scale)
    for segment in meta.prefills:
        rows = slice(segment.token_start, segment.token_end)
        out[rows] = _prefill_attention(query[rows], kv_layer, segment, scale)
    return out


def _gather(kv_layer: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks in `block_table` ([n]) as [kv_heads, n*block, dim]: each
    copied once, whole blocks at a time (a block's K or V is one contiguous run), not
    gathered together and then copied apart."""
    kv_heads, dim = kv_layer.shape[-2:]
    keys, values = (
        kv_layer[:, part].flatten(1).index_select(0, block_table).view(-1, kv_heads, dim)
        for part in (0, 1)
    )  # [n*block, kvh, dim]
    return keys.transpose(0, 1), values.transpose(0, 1)


def _decode_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """All decodes in one call, grouped by KV head: each KV head's query heads attend
    to it together, so K and V are gathered once (whole rows of blocks, one copy
    each) and never repeated for the heads that share them."""
    decodes, heads, dim = query.shape
    kv_heads = kv_layer.shape[-2]
    rows = meta.decode_block_tables.flatten()
    keys, values = (
        kv_layer[:, part].flatten(1).index_select(0, rows).view(decodes, -1, kv_heads, dim)
        for part in (0, 1)
    )  # [D, L, kvh, dim]
    positions = torch.arange(keys.shape[1], device=query.device)
    mask = positions[None, :] < meta.decode_context_lens[:, None]  # [D, L]
    attended = F.scaled_dot_product_attention(
        query.reshape(decodes, kv_heads, heads // kv_heads, dim),  # [D, kvh, group, dim]
        keys.transpose(1, 2).to(query.dtype),
        values.transpose(1, 2).to(query.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return attended.reshape(decodes, heads, dim)


def _prefill_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, segment: PrefillSegment, scale: float
) -> torch.Tensor:
    keys, values = _gather(kv_layer, segment.block_table)  # [kvh, L_pad, dim]
    context = segment.context_len
    keys, values = keys[:, :context], values[:, :context]
    num_queries = query.shape[0]
    # Query i sits at position context - num_queries + i and sees keys up to it.
    query_positions = torch.arange(context - num_queries, context, device=query.device)
    key_positions = torch.arange(context, device=query.device)
    mask = key_positions[None, :] <= query_positions[:, None]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1),  # [heads, n, dim]
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return attended.transpose(0, 1)
