"""Engine configuration: the model's architecture (read from config.json) and the
engine's own settings, as frozen dataclasses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from pdserve.workers.engine.logprobs import LOGPROBS_MODES, LogprobsMode

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ConfigError(ValueError):
    """A configuration the engine cannot run (bad model directory, settings that conflict)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of a checkpoint (`rope_scaling` in config.json)."""

    kind: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, as Hugging Face's config.json says."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in the model's dtype."""
        itemsize = torch.empty((), dtype=DTYPES.get(self.torch_dtype, torch.float32)).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Read config.json of a Hugging Face checkpoint directory."""
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir} is not a model directory: no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed config.json."""
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {architecture!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(raw.get("rope_scaling")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v and says so only through its architecture.
            attention_bias=bool(raw.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = str(raw.get("rope_type") or raw.get("type") or "default")
    if kind == "default":
        return None
    if kind not in {"linear", "llama3"}:
        raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, and its size as a block count or a byte budget."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    hash_seed: str = ""  # the root of the prefix hashes (see kv_cache.seed_root)

    def resolve_num_blocks(self, model: ModelConfig, kv_itemsize: int) -> int:
        """The number of blocks to allocate (default: enough for 8 full contexts)."""
        if self.num_blocks is not None:
            return self.num_blocks
        block_bytes = (
            2 * model.num_layers * self.block_size * model.num_kv_heads * model.head_dim
        ) * kv_itemsize
        if self.memory_bytes is not None:
            return self.memory_bytes // block_bytes
        return 8 * -(-model.max_position_embeddings // self.block_size)


BudgetMode = Literal["static", "adaptive"]
BUDGET_MODES: tuple[BudgetMode, ...] = ("static", "adaptive")
PrefillOrder = Literal["shortest", "arrival"]
PREFILL_ORDERS: tuple[PrefillOrder, ...] = ("shortest", "arrival")
DEFAULT_MIN_BUDGET = 32


@dataclass(frozen=True)
class TokenBudgetConfig:
    """How each step's token budget is chosen.

    static: every step may compute `max_num_batched_tokens` tokens. adaptive: each
    step gets the most prefill tokens whose predicted time keeps the running decodes'
    inter-token latency under `target_itl_s`; `min_budget` prefill tokens while a
    prompt waits where the decodes alone already miss the target (never taking a step
    they keep under it over), and at most `max_budget` tokens in all
    (None: `max_num_batched_tokens`). A target given in static mode only counts the
    steps that overran it.
    """

    mode: BudgetMode = "static"
    target_itl_s: float | None = None
    min_budget: int = DEFAULT_MIN_BUDGET
    max_budget: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in BUDGET_MODES:
            raise ConfigError(f"unknown token budget mode {self.mode!r}; known: static, adaptive")
        if self.target_itl_s is not None and not self.target_itl_s > 0:
            raise ConfigError(f"the ITL target must be positive, got {self.target_itl_s}")
        if self.mode == "adaptive" and self.target_itl_s is None:
            raise ConfigError("an adaptive token budget needs an ITL target")
        if self.min_budget < 1 or (self.max_budget is not None and self.max_budget < 1):
            raise ConfigError("token budget bounds must be positive")
        if self.max_budget is not None and self.min_budget > self.max_budget:
            raise ConfigError(
                f"the token budget's floor ({self.min_budget}) exceeds its ceiling "
                f"({self.max_budget})"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget and batch limits of one engine step."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    token_budget: TokenBudgetConfig = field(default_factory=TokenBudgetConfig)
    # The order prompts take what the decodes leave of a step's budget: "shortest"
    # (fewest tokens left to compute first, aged prompts first) or "arrival" (first
    # come, first served); see scheduler.py.
    prefill_order: PrefillOrder = "shortest"
    # Steps in which later arrivals may be served before a prompt before it ages.
    max_prefill_overtakes: int = 32

    def __post_init__(self) -> None:
        if self.prefill_order not in PREFILL_ORDERS:
            raise ConfigError(
                f"unknown prefill order {self.prefill_order!r}; one of {', '.join(PREFILL_ORDERS)}"
            )
        if self.max_prefill_overtakes < 0:
            raise ConfigError("max_prefill_overtakes must not be negative")
        budget = self.token_budget
        if budget.mode != "adaptive":
            return
        if not self.enable_chunked_prefill:
            raise ConfigError("an adaptive token budget needs chunked prefill")
        if budget.min_budget > self.budget_ceiling:
            raise ConfigError(
                f"the token budget's floor ({budget.min_budget}) exceeds its ceiling "
                f"({self.budget_ceiling})"
            )

    @property
    def budget_ceiling(self) -> int:
        """The most tokens an adaptive step computes."""
        return self.token_budget.max_budget or self.max_num_batched_tokens


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start."""

    model_dir: Path
    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's dtype (float32 on CPU for halves)
    kv_cache_dtype: str | None = None  # None: the compute dtype
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    served_model_name: str | None = None
    # How long a prefill worker keeps a finished prompt's blocks for their transfer.
    handoff_lease_s: float = 30.0
    # Which log-probabilities requests get: the model's (raw) or the sampler's
    # (processed: after temperature, top-k, top-p and min_tokens).
    logprobs_mode: LogprobsMode = "raw_logprobs"

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(
                f"unknown logprobs mode {self.logprobs_mode!r}; known: {', '.join(LOGPROBS_MODES)}"
            )
