"""A Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, grouped-query
attention over the paged KV cache, SwiGLU. Parameter names match Hugging Face's,
so a safetensors checkpoint loads with a plain state-dict load."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from pdserve.workers.engine.attention import AttentionMetadata, paged_attention, write_kv
from pdserve.workers.engine.config import ConfigError, ModelConfig, RopeScaling


# Every weight comes from the checkpoint, so the layers skip torch's random
# initialisation: on the meta device it is not just wasted work, it imports torch's
# compiler (seconds of CPU at every worker start).
class Linear(nn.Linear):
    """nn.Linear without random initialisation."""

    def reset_parameters(self) -> None:
        """Nothing: the checkpoint supplies the weights."""


class Embedding(nn.Embedding):
    """nn.Embedding without random initialisation."""

    def reset_parameters(self) -> None:
        """Nothing: the checkpoint supplies the weights."""


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 as the reference does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden32 = hidden.float()
        variance = hidden32.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden32 * torch.rsqrt(variance + self.eps)).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout), with optional frequency scaling."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.head_dim
        # A table computed, never loaded: on the CPU even while the model is built on
        # the meta device (arithmetic on meta tensors imports torch's compiler).
        with torch.device("cpu"):
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
            if config.rope_scaling is not None:
                inv_freq = _scale_frequencies(inv_freq, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> Rotation:
        """The rotation of a batch's positions, for every layer to apply."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, dim]
        return Rotation(angles.cos(), angles.sin())


@dataclass(frozen=True)
class Rotation:
    """The rotary angles of a batch's positions, computed once per forward: every layer
    rotates its queries and keys by the same ones."""

    cos: torch.Tensor  # [T, 1, dim]
    sin: torch.Tensor

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query and key rotated to their positions."""
        return _rotate(query, self.cos, self.sin), _rotate(key, self.cos, self.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def _scale_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Attention(nn.Module):
    """Grouped-query self-attention writing to and reading from the paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        hidden, q_size = config.hidden_size, config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = Linear(hidden, q_size, bias=bias)
        self.k_proj = Linear(hidden, kv_size, bias=bias)
        self.v_proj = Linear(hidden, kv_size, bias=bias)
        self.o_proj = Linear(q_size, hidden, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        rotation: Rotation,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        query = self.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
        key = self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        query, key = rotation.apply(query, key)
        write_kv(kv_layer, key, value, meta)
        attended = paged_attention(query, kv_layer, meta, self.scale)
        projected: torch.Tensor = self.o_proj(attended.reshape(tokens, -1))
        return projected


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gated = nn.functional.silu(self.gate_proj(hidden)) * self.up_proj(hidden)
        projected: torch.Tensor = self.down_proj(gated)
        return projected


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rotation: Rotation,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rotation, kv_layer, meta)
        hidden = hidden + attended
        output: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return output


class DecoderStack(nn.Module):
    """Embedding, the decoder layers and the final norm (`model.` in checkpoints)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder with its language-model head; the engine's model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run the flattened batch; return float32 logits of `logits_rows` only.

        kv_cache is [num_layers, num_blocks, 2, block_size, kv_heads, head_dim].
        """
        hidden = self.model.embed_tokens(input_ids)
        rotation = self.rotary(positions)
        for index, layer in enumerate(self.model.layers):
            hidden = layer(hidden, rotation, kv_cache[index], meta)
        hidden = self.model.norm(hidden[logits_rows])
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()


def load_model(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: str) -> CausalLM:
    """Build the model and load a (possibly sharded) safetensors checkpoint into it."""
    with torch.device("meta"):
        model = CausalLM(config)
    state = _read_safetensors(model_dir)
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    # Some checkpoints carry rotary buffers; they are recomputed here.
    unexpected = {name for name in unexpected if "rotary_emb" not in name}
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint in {model_dir} does not fit the architecture: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    state = {name: state[name] for name in expected}
    model.load_state_dict(state, assign=True, strict=True)
    # The rotary buffer is rebuilt rather than cast: it was made on the meta device,
    # and RoPE angles stay in float32 whatever the weights' dtype.
    del model.rotary
    model = model.to(device=device, dtype=dtype)
    model.rotary = RotaryEmbedding(config).to(device)
    return model.eval()


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, in a fixed order (the shards its index names, or
    every *.safetensors file). ConfigError when there are none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / shard for shard in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no safetensors weights in {model_dir}")
    return files


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        state.update(load_file(str(file)))
    return state
