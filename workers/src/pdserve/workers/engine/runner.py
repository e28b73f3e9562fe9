"""The model runner: owns the model and the KV cache tensor, turns a scheduled step
into batch tensors, runs the forward pass and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.workers.engine.attention import AttentionMetadata, PrefillSegment
from pdserve.workers.engine.config import DTYPES, ConfigError, EngineConfig, ModelConfig
from pdserve.workers.engine.model import CausalLM, load_model
from pdserve.workers.engine.request import Request
from pdserve.workers.engine.sampler import Sampler
from pdserve.workers.engine.scheduler import ScheduledChunk, SchedulerOutput

BlockTables = Callable[[str], list[int]]


def resolve_kv_dtype(config: EngineConfig, model: ModelConfig) -> torch.dtype:
    """The KV cache's dtype: as asked, else the compute dtype."""
    if config.kv_cache_dtype is None:
        return resolve_dtype(config, model)
    if config.kv_cache_dtype not in DTYPES:
        raise ConfigError(f"unsupported KV cache dtype {config.kv_cache_dtype!r}")
    return DTYPES[config.kv_cache_dtype]


def resolve_dtype(config: EngineConfig, model: ModelConfig) -> torch.dtype:
    """The compute dtype: as asked, else the checkpoint's; half types fall back to
    float32 on CPU unless asked for, since CPU half-precision matmuls are slow."""
    name = config.dtype or model.torch_dtype
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    if config.dtype is None and config.device == "cpu":
        return torch.float32
    return DTYPES[name]


@dataclass(frozen=True)
class Batch:
    """The tensors of one forward pass and which chunk each sampled row belongs to."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampling_chunks: tuple[ScheduledChunk, ...]


class ModelRunner:
    """Runs steps of the model over the paged KV cache."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, num_blocks: int, block_size: int
    ) -> None:
        self.device = config.device
        self.dtype = resolve_dtype(config, model_config)
        self.block_size = block_size
        self.model: CausalLM = load_model(config.model_dir, model_config, self.dtype, self.device)
        self.kv_cache = torch.zeros(
            (
                model_config.num_layers,
                num_blocks,
                2,
                block_size,
                model_config.num_kv_heads,
                model_config.head_dim,
            ),
            dtype=resolve_kv_dtype(config, model_config),
            device=self.device,
        )
        self.sampler = Sampler(self.device, config.seed, frozenset(model_config.eos_token_ids))

    def execute(
        self, output: SchedulerOutput, block_tables: BlockTables
    ) -> list[tuple[Request, int]]:
        """Run one step; return the token sampled for each request that reached the
        end of its tokens."""
        batch = self.prepare(output, block_tables)
        logits = self.model(
            batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.logits_rows
        )
        requests = [chunk.request for chunk in batch.sampling_chunks]
        tokens = self.sampler.sample(logits, requests)
        return list(zip(requests, tokens, strict=True))

    def prepare(self, output: SchedulerOutput, block_tables: BlockTables) -> Batch:
        """Flatten the step's chunks into batch tensors: single-token chunks first, as
        they take the batched decode path."""
        chunks = sorted(output.chunks, key=lambda chunk: chunk.num_tokens > 1)
        token_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        logits_rows: list[int] = []
        sampling: list[ScheduledChunk] = []
        for chunk in chunks:
            table = block_tables(chunk.request.request_id)
            start, end = chunk.start, chunk.start + chunk.num_tokens
            row = len(token_ids)
            token_ids.extend(chunk.request.all_token_ids[start:end])
            span = range(start, end)
            positions.extend(span)
            slot_blocks.extend(table[p // self.block_size] for p in span)
            slot_offsets.extend(p % self.block_size for p in span)
            used_blocks = table[: -(-end // self.block_size)]
            if chunk.num_tokens == 1:
                decode_tables.append(used_blocks)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSegment(row, len(token_ids), end, self._long(used_blocks)))
            if chunk.samples:
                logits_rows.append(len(token_ids) - 1)
                sampling.append(chunk)
        width = max((len(t) for t in decode_tables), default=0)
        meta = AttentionMetadata(
            slot_blocks=self._long(slot_blocks),
            slot_offsets=self._long(slot_offsets),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=self._long([t + [0] * (width - len(t)) for t in decode_tables]),
            decode_context_lens=self._long(decode_lens),
            prefills=tuple(prefills),
        )
        return Batch(
            self._long(token_ids),
            self._long(positions),
            meta,
            self._long(logits_rows),
            tuple(sampling),
        )

    def _long(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
