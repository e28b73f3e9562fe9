"""Attention over the paged KV cache.

The cache of one layer is a tensor [num_blocks, 2, block_size, num_kv_heads, head_dim]:
each block holds its K and V side by side, so a block is one contiguous run of
memory per layer (a KV transfer moves a few large runs, not many small pieces).

A batch is flattened into one token axis: decode tokens first (one per sequence,
attended to in a few padded batched calls, one per group of similar context lengths,
see `group_decodes`), then prefill chunks (one call each, with a
causal mask offset by the tokens already in the cache; a chunk over a long cached
prefix in two parts, see `_split_prefill_attention`). The same code runs on CPU and
CUDA; scaled_dot_product_attention picks the fused kernel of the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.workers.engine.decode_groups import group_rows


@dataclass(frozen=True)
class PrefillSegment:
    """One prefill chunk in the flattened batch."""

    token_start: int  # first row of the chunk in the batch
    token_end: int  # one past its last row
    context_len: int  # tokens in the cache once this chunk is written (chunk included)
    block_table: torch.Tensor  # [num_blocks_of_seq] long


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes attended to in one call, each padded to the longest of the group."""

    rows: torch.Tensor | None  # [g] long, the group's decode rows; None: all of them, in order
    block_tables: torch.Tensor  # [g, max_blocks] long, padded with 0
    context_lens: torch.Tensor  # [g] long, tokens in cache incl. the new one


def group_decodes(
    tables: list[list[int]], lens: list[int], device: str | torch.device
) -> tuple[DecodeGroup, ...]:
    """The decodes (each one's block table and context length) in groups of similar
    context length, computed on the host from the lengths the batch is built from: so
    one long context in the batch does not make every short one attend over its length."""
    if not tables:
        return ()
    widths = [len(table) for table in tables]
    groups = group_rows(lens)  # the step-cost model counts keys by the same groups
    if groups is None:  # one group: no sort, no indices
        return (_decode_group(None, tables, widths, lens, max(widths), device),)
    return tuple(
        _decode_group(rows, tables, widths, lens, max(widths[row] for row in rows), device)
        for rows in groups
    )


def _decode_group(
    rows: list[int] | None,
    tables: list[list[int]],
    widths: list[int],
    lens: list[int],
    width: int,
    device: str | torch.device,
) -> DecodeGroup:
    """The decodes `rows` (None: all of them) with their tables padded to `width`."""
    picked = range(len(tables)) if rows is None else rows
    # One flat list to one tensor: torch builds a nested list's tensor slowly.
    padded = [block for row in picked for block in (*tables[row], *[0] * (width - widths[row]))]
    picked_lens = lens if rows is None else [lens[row] for row in rows]
    return DecodeGroup(
        rows=None if rows is None else torch.tensor(rows, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(picked), width),
        context_lens=torch.tensor(picked_lens, dtype=torch.long, device=device),
    )


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to."""

    slot_blocks: torch.Tensor  # [T] block id receiving each token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decodes
    decode_groups: tuple[DecodeGroup, ...]  # the decodes, by context length (group_decodes)
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
    for group in meta.decode_groups:
        if group.rows is None:
            out[:decodes] = _decode_attention(query[:decodes], kv_layer, group, scale)
        else:
            attended = _decode_attention(query.index_select(0, group.rows), kv_layer, group, scale)
            out.index_copy_(0, group.rows, attended)
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
    query: torch.Tensor, kv_layer: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    """A group's decodes in one call, grouped by KV head: each KV head's query heads attend
    to it together, so K and V are gathered once (whole rows of blocks, one copy
    each) and never repeated for the heads that share them."""
    decodes, heads, dim = query.shape
    kv_heads = kv_layer.shape[-2]
    rows = group.block_tables.flatten()
    keys, values = (
        kv_layer[:, part].flatten(1).index_select(0, rows).view(decodes, -1, kv_heads, dim)
        for part in (0, 1)
    )  # [D, L, kvh, dim]
    positions = torch.arange(keys.shape[1], device=query.device)
    mask = positions[None, :] < group.context_lens[:, None]  # [D, L]
    attended = F.scaled_dot_product_attention(
        query.reshape(decodes, kv_heads, heads // kv_heads, dim),  # [D, kvh, group, dim]
        keys.transpose(1, 2).to(query.dtype),
        values.transpose(1, 2).to(query.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return attended.reshape(decodes, heads, dim)


# A chunk attends over its cached prefix in two parts when the prefix is long enough
# for it to pay: the cached keys with no mask (the fused kernel's fast path) and the
# chunk's own keys, causal. Below these sizes one masked call is faster: on CPU the
# split's copies and the chunk's own square outweigh the mask up to ~2,048 cached
# tokens, and the copies (as many as the cached keys) the attention of a chunk of 16
# queries (tests/bench/test_prefill_attention.py).
SPLIT_MIN_CACHED = 4096  # cached tokens before the chunk
SPLIT_MIN_CHUNK = 64  # the chunk's queries
SPLIT_MAX_CHUNK = 1024  # the chunk's own scores are computed whole: [heads, n, n]


def _prefill_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, segment: PrefillSegment, scale: float
) -> torch.Tensor:
    """Attention of a chunk's queries ([n, heads, dim]) over its sequence's cache."""
    keys, values = _gather(kv_layer, segment.block_table)  # [kvh, L_pad, dim]
    context = segment.context_len
    num_queries = query.shape[0]
    cached = context - num_queries
    if cached >= SPLIT_MIN_CACHED and SPLIT_MIN_CHUNK <= num_queries <= SPLIT_MAX_CHUNK:
        return _split_prefill_attention(
            query, keys[:, :context], values[:, :context], cached, scale
        )
    keys, values = keys[:, :context], values[:, :context]
    # Query i sits at position context - num_queries + i and sees keys up to it.
    query_positions = torch.arange(cached, context, device=query.device)
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


def _split_prefill_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int, scale: float
) -> torch.Tensor:
    """The same attention as one causal call over `keys`/`values` ([kvh, context, dim],
    the first `cached` before the chunk), computed in two parts merged exactly.

    The chunk's own keys: a small causal square computed here in float32, giving its
    output o2 and log-sum-exp l2 per query. The cached keys, which every query sees
    whole: one unmasked scaled_dot_product_attention per KV head with that head's
    query heads stacked as rows (no repeated K/V, no mask: the fused kernel's fastest
    path on CPU and CUDA alike). That call cannot return its log-sum-exp, which the
    merge needs, so it gets one key more, standing for the chunk: a head dimension is
    added, 0 on every cached key and 1 on that key, and each query carries l2 / scale
    in it, so that key scores l2 exactly for its own query and the cached keys score as
    before; its value is 0 but for a 1 in the added dimension. The output's added
    column is then the chunk's share of the softmax and the rest the cached part's
    weighted values: merged = (o1' + w o2) / (1 - e + w), with e that column and
    w = e exp(l2 - c) (c: the score the kernel gave, l2 as the query's dtype holds it).
    """
    num_queries, heads, dim = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    rows = group * num_queries
    grouped = query.transpose(0, 1).reshape(kv_heads, group, num_queries, dim)

    # The chunk's own keys, causal: query i sees chunk keys 0..i. The log-sum-exp is
    # read off the softmax at each row's largest score (a weight of at least 1/n there,
    # so its log is exact to rounding): torch.logsumexp and exp over the masked square
    # cost several times the softmax on CPU.
    own_keys = keys[:, None, cached:].float()  # [kvh, 1, n, dim]
    own_values = values[:, None, cached:].float()
    scores = torch.matmul(grouped.float(), own_keys.transpose(-1, -2)).mul_(scale)
    later = torch.ones(num_queries, num_queries, dtype=torch.bool, device=query.device).triu_(1)
    scores.masked_fill_(later, float("-inf"))  # [kvh, g, n, n]
    top, where = scores.max(dim=-1, keepdim=True)
    weights = torch.softmax(scores, dim=-1)
    own_lse = (top - weights.gather(-1, where).log()).squeeze(-1)  # [kvh, g, n]
    own_out = torch.matmul(weights, own_values)  # [kvh, g, n, dim]

    # The cached keys, unmasked, with the chunk's stand-in key last. CUDA's fused
    # kernels want head dimensions in multiples of 8 (zeros change no score or value);
    # on CPU one more column costs least.
    width = dim + 1 if query.device.type == "cpu" else -(-(dim + 1) // 8) * 8
    stacked = query.new_zeros(kv_heads, rows, width)
    stacked[..., :dim] = grouped.reshape(kv_heads, rows, dim)
    stacked[..., dim] = (own_lse / scale).reshape(kv_heads, rows)
    cached_keys = _with_stand_in(keys[:, :cached], width)
    cached_values = _with_stand_in(values[:, :cached], width)
    attended = F.scaled_dot_product_attention(
        stacked[None], cached_keys[None], cached_values[None], scale=scale
    )[0].float()  # [kvh, rows, width]

    share = attended[..., dim]  # the stand-in key's softmax weight, e
    given = stacked[..., dim].float() * scale  # the score it had, c
    weight = share * torch.exp(own_lse.reshape(kv_heads, rows) - given)
    own = own_out.reshape(kv_heads, rows, dim)
    merged = (attended[..., :dim] + weight[..., None] * own) / (1 - share + weight)[..., None]
    heads_first = merged.view(kv_heads, group, num_queries, dim).reshape(heads, num_queries, dim)
    return heads_first.transpose(0, 1).to(query.dtype)


def _with_stand_in(part: torch.Tensor, width: int) -> torch.Tensor:
    """`part` ([kvh, cached, dim]) widened to `width` with zeros, and one row more: the
    stand-in key (or value), 0 but for a 1 in column `dim`. Written once: only the
    added columns and row are zeroed."""
    kv_heads, cached, dim = part.shape
    out = part.new_empty(kv_heads, cached + 1, width)
    out[:, :cached, :dim] = part
    out[:, :cached, dim:] = 0
    out[:, cached] = 0
    out[:, cached, dim] = 1
    return out
