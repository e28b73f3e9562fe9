"""The model runner: owns the model and the KV cache tensor, turns a scheduled step
into batch tensors, runs the forward pass and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.workers import faults
from pdserve.workers.engine.attention import AttentionMetadata, PrefillSegment, group_decodes
from pdserve.workers.engine.config import DTYPES, ConfigError, EngineConfig, ModelConfig
from pdserve.workers.engine.isolation import RequestFailure
from pdserve.workers.engine.logprobs import TokenLogprob, token_logprobs
from pdserve.workers.engine.model import CausalLM, load_model
from pdserve.workers.engine.request import Request
from pdserve.workers.engine.sampler import Sampled, Sampler
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
class PromptRows:
    """Logits rows of a chunk whose prompt log-probabilities are asked for: rows
    [first_row, first_row + len(targets)) hold the distributions of `targets`, the
    prompt tokens from index `first_token` on."""

    request: Request
    first_row: int
    first_token: int
    targets: list[int]


@dataclass(frozen=True)
class Batch:
    """The tensors of one forward pass, which chunk each sampled row belongs to, and
    the rows that give prompt log-probabilities."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampling_chunks: tuple[ScheduledChunk, ...]
    sampling_rows: tuple[int, ...] = ()  # where each sampling chunk's row is in the logits
    prompt_rows: tuple[PromptRows, ...] = ()
    # Chunks that complete a prompt whose request samples nothing (max_tokens 0).
    scoring_chunks: tuple[ScheduledChunk, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """What a step's forward pass produced for its requests."""

    sampled: list[tuple[Request, Sampled]]
    # Prompt log-probabilities computed this step: (request, first token index, entries).
    prompt_logprobs: list[tuple[Request, int, list[TokenLogprob]]]
    # Requests whose draw failed (the others' went on).
    failures: list[RequestFailure] = field(default_factory=list)

    @classmethod
    def merged(cls, outputs: list[StepOutput]) -> StepOutput:
        """The outputs of a step run in parts, as one."""
        return cls(
            [item for output in outputs for item in output.sampled],
            [item for output in outputs for item in output.prompt_logprobs],
            [item for output in outputs for item in output.failures],
        )


class StepRunner(Protocol):
    """What the engine asks of a runner: the model runner, or a runner that takes a
    step's time from a profile instead of computing it (`pdserve.workers.plan`)."""

    kv_cache: torch.Tensor

    def execute(self, output: SchedulerOutput, block_tables: BlockTables) -> StepOutput:
        """Run one step; what each request that reached the end of its tokens drew."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination): a fork's partial last block."""


# Builds an engine's runner from its configuration, the model's, and the KV cache's
# block count and block size.
RunnerFactory = Callable[[EngineConfig, ModelConfig, int, int], StepRunner]


class ModelRunner:
    """Runs steps of the model over the paged KV cache."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, num_blocks: int, block_size: int
    ) -> None:
        self.device = config.device
        self.dtype = resolve_dtype(config, model_config)
        self.block_size = block_size
        self.model: CausalLM = load_model(config.model_dir, model_config, self.dtype, self.device)
        # Indexed [layer, block, 2, block_size, kv_heads, head_dim], stored blocks
        # outermost: every layer of a run of blocks is one range of memory, which a
        # P/D hand-off moves as one copy rather than one per layer.
        self.kv_cache = torch.zeros(
            (
                num_blocks,
                model_config.num_layers,
                2,
                block_size,
                model_config.num_kv_heads,
                model_config.head_dim,
            ),
            dtype=resolve_kv_dtype(config, model_config),
            device=self.device,
        ).transpose(0, 1)
        self.sampler = Sampler(
            self.device,
            config.seed,
            frozenset(model_config.eos_token_ids),
            config.logprobs_mode,
        )

    def execute(self, output: SchedulerOutput, block_tables: BlockTables) -> StepOutput:
        """Run one step: what each request that reached the end of its tokens drew
        (nothing for a request with max_tokens 0), and the prompt log-probabilities
        the step computed."""
        batch = self.prepare(output, block_tables)
        labels = [chunk.request.label for chunk in output.chunks]
        faults.blocking_point("engine.forward", len(labels), labels)
        logits = self.model(
            batch.input_ids, batch.positions, self.kv_cache, batch.meta, batch.logits_rows
        )
        requests = [chunk.request for chunk in batch.sampling_chunks]
        drawn = (
            self.sampler.sample(self._sampling_logits(logits, batch), requests) if requests else []
        )
        sampled = [(r, d) for r, d in zip(requests, drawn, strict=True) if isinstance(d, Sampled)]
        failures = [
            RequestFailure(r, d) for r, d in zip(requests, drawn, strict=True)
            if not isinstance(d, Sampled)
        ]  # fmt: skip
        sampled += [(chunk.request, Sampled([])) for chunk in batch.scoring_chunks]
        scored = [self._prompt_logprobs(logits, rows) for rows in batch.prompt_rows]
        return StepOutput(sampled, scored, failures)

    def _sampling_logits(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The rows of the logits that sample, in the order of the sampling chunks
        (all of them, as they are, in a step of decodes only: no copy)."""
        rows = batch.sampling_rows
        if len(rows) == logits.shape[0] and rows == tuple(range(len(rows))):
            return logits
        return logits[torch.tensor(rows, dtype=torch.long, device=self.device)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer: a fork's partial last
        block, before any of its choices writes into it."""
        if not copies:
            return
        sources = self._long([source for source, _ in copies])
        destinations = self._long([destination for _, destination in copies])
        self.kv_cache[:, destinations] = self.kv_cache[:, sources]

    def _prompt_logprobs(
        self, logits: torch.Tensor, rows: PromptRows
    ) -> tuple[Request, int, list[TokenLogprob]]:
        params = rows.request.params
        assert params.prompt_logprobs is not None
        span = logits[rows.first_row : rows.first_row + len(rows.targets)]
        if self.sampler.logprobs_mode == "processed_logprobs":
            values = self.sampler.processed(span, params)
        else:
            values = torch.log_softmax(span, dim=-1)
        width = [params.prompt_logprobs] * len(rows.targets)
        return rows.request, rows.first_token, token_logprobs(values, rows.targets, width)

    def prepare(self, output: SchedulerOutput, block_tables: BlockTables) -> Batch:
        """Flatten the step's chunks into batch tensors: single-token chunks first, as
        they take the batched decode path."""
        builder = _BatchBuilder(self.block_size, self.device)
        for chunk in sorted(output.chunks, key=lambda chunk: chunk.num_tokens > 1):
            builder.add(chunk, block_tables(chunk.request.request_id))
        return builder.build()

    def _long(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


class _BatchBuilder:
    """Collects a step's chunks into the lists a Batch is made of."""

    def __init__(self, block_size: int, device: str) -> None:
        self.block_size = block_size
        self.device = device
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.slot_blocks: list[int] = []
        self.slot_offsets: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.prefills: list[PrefillSegment] = []
        self.logits_rows: list[int] = []
        self.sampling: list[ScheduledChunk] = []
        self.sampling_rows: list[int] = []
        self.prompt_rows: list[PromptRows] = []
        self.scoring: list[ScheduledChunk] = []

    def add(self, chunk: ScheduledChunk, table: list[int]) -> None:
        """Append a chunk's tokens, their KV slots, and the logits rows it needs."""
        faults.blocking_point("engine.prepare", labels=(chunk.request.label,))
        start, end = chunk.start, chunk.start + chunk.num_tokens
        row = len(self.token_ids)
        self.token_ids.extend(chunk.request.token_ids_between(start, end))
        used_blocks = table[: -(-end // self.block_size)]
        if chunk.num_tokens == 1:  # most chunks: one slot, no per-token loops
            self.positions.append(start)
            self.slot_blocks.append(used_blocks[-1])
            self.slot_offsets.append(start % self.block_size)
            self.decode_tables.append(used_blocks)
            self.decode_lens.append(end)
        else:
            span = range(start, end)
            self.positions.extend(span)
            self.slot_blocks.extend(table[p // self.block_size] for p in span)
            self.slot_offsets.extend(p % self.block_size for p in span)
            segment = PrefillSegment(row, len(self.token_ids), end, self._long(used_blocks))
            self.prefills.append(segment)
        self._add_logits_rows(chunk, row)

    def _add_logits_rows(self, chunk: ScheduledChunk, row: int) -> None:
        """Rows for the prompt log-probabilities the chunk gives, then its sampling row."""
        scored = _scored_positions(chunk)
        if scored:
            prompt = chunk.request.prompt_token_ids
            targets = [prompt[p + 1] for p in scored]
            first_row = len(self.logits_rows)
            self.prompt_rows.append(PromptRows(chunk.request, first_row, scored[0] + 1, targets))
            self.logits_rows.extend(row + p - chunk.start for p in scored)
        if chunk.samples and chunk.request.samples:
            self.sampling_rows.append(len(self.logits_rows))
            self.logits_rows.append(len(self.token_ids) - 1)
            self.sampling.append(chunk)
        elif chunk.samples:
            self.scoring.append(chunk)

    def build(self) -> Batch:
        """The batch's tensors."""
        long = self._long
        meta = AttentionMetadata(
            slot_blocks=long(self.slot_blocks),
            slot_offsets=long(self.slot_offsets),
            num_decode_tokens=len(self.decode_tables),
            decode_groups=group_decodes(self.decode_tables, self.decode_lens, self.device),
            prefills=tuple(self.prefills),
        )
        return Batch(
            long(self.token_ids),
            long(self.positions),
            meta,
            long(self.logits_rows),
            tuple(self.sampling),
            tuple(self.sampling_rows),
            tuple(self.prompt_rows),
            tuple(self.scoring),
        )

    def _long(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _scored_positions(chunk: ScheduledChunk) -> range:
    """Positions of the chunk whose logits give prompt log-probabilities not yet
    computed: position p gives that of prompt token p + 1."""
    request = chunk.request
    if request.prompt_logprobs is None:
        return range(0)
    done = len(request.prompt_logprobs)  # tokens 1..done have theirs
    last = request.num_prompt_tokens - 1  # the last prompt position predicts no prompt token
    return range(max(chunk.start, done), min(chunk.start + chunk.num_tokens, last))
