"""Random tiny Llama checkpoints in Hugging Face format.

`write_tiny_checkpoint` writes a directory that both this project's engine and
Hugging Face transformers load: config.json, generation_config.json,
model.safetensors (tensor names as in transformers' LlamaForCausalLM) and a
tokenizer trained for it. Same spec and seed, same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.workers.model import tiny_tokenizer

if TYPE_CHECKING:
    import torch

# Projection weights follow the usual 0.02 init. Two things keep a random model from
# collapsing into one repeated token: a larger embedding scale (the residual stream
# keeps the current token's identity) and sharper attention scores (the output
# depends on which earlier tokens are attended to, not on their plain average).
_PROJECTION_STD = 0.02
_QUERY_KEY_STD = 0.08
_EMBEDDING_STD = 1.0
_LM_HEAD_STD = 0.02
# Norm weights near 1, but not exactly 1: a missed or misplaced norm weight then
# changes the logits, so parity tests catch it.
_NORM_NOISE_STD = 0.1


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a random tiny Llama model.

    The defaults run at interactive speed on two CPU cores in fp32.
    """

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 704
    vocab: int = 4096
    max_position: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_position")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim (hidden / heads = {self.head_dim}) must be even for RoPE")
        if self.vocab < tiny_tokenizer.MIN_VOCAB_SIZE:
            raise ValueError(f"vocab must be at least {tiny_tokenizer.MIN_VOCAB_SIZE}")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.heads

    def parameter_count(self) -> int:
        """Number of weights in the checkpoint."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


def write_tiny_checkpoint(directory: Path, spec: TinyModelSpec, *, overwrite: bool = False) -> None:
    """Write a random Llama checkpoint and its tokenizer to `directory`.

    The files are written to a temporary directory next to it and renamed into place,
    so a crash leaves no half-written model. Raises FileExistsError if `directory`
    exists and is not empty, unless `overwrite` is set.
    """
    directory = Path(directory)
    with _publish_directory(directory, overwrite) as staging:
        tiny_tokenizer.write_tokenizer(staging, spec.vocab, spec.max_position)
        bos_id = tiny_tokenizer.special_token_id(spec.vocab, tiny_tokenizer.BOS_TOKEN)
        # Plain completions end with end-of-text, chat replies with end-of-turn.
        end_tokens = (tiny_tokenizer.EOS_TOKEN, tiny_tokenizer.EOT_TOKEN)
        eos_ids = [tiny_tokenizer.special_token_id(spec.vocab, token) for token in end_tokens]
        _write_json(staging / "config.json", llama_config(spec, bos_id, eos_ids))
        _write_json(
            staging / "generation_config.json",
            {"bos_token_id": bos_id, "eos_token_id": eos_ids, "do_sample": False},
        )
        _write_weights(staging / "model.safetensors", spec)


def llama_config(spec: TinyModelSpec, bos_id: int, eos_ids: list[int]) -> dict[str, object]:
    """The config.json content for `spec`, as transformers' LlamaConfig reads it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "use_cache": True,
    }


def _write_json(path: Path, content: object) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def _weight_shapes(spec: TinyModelSpec) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """(name, shape, std) of every weight, in a fixed order; std 0 marks a norm."""
    q_size, kv_size = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    yield "model.embed_tokens.weight", (spec.vocab, spec.hidden), _EMBEDDING_STD
    for i in range(spec.layers):
        prefix = f"model.layers.{i}"
        yield f"{prefix}.input_layernorm.weight", (spec.hidden,), 0.0
        yield f"{prefix}.self_attn.q_proj.weight", (q_size, spec.hidden), _QUERY_KEY_STD
        yield f"{prefix}.self_attn.k_proj.weight", (kv_size, spec.hidden), _QUERY_KEY_STD
        yield f"{prefix}.self_attn.v_proj.weight", (kv_size, spec.hidden), _PROJECTION_STD
        yield f"{prefix}.self_attn.o_proj.weight", (spec.hidden, q_size), _PROJECTION_STD
        yield f"{prefix}.post_attention_layernorm.weight", (spec.hidden,), 0.0
        yield f"{prefix}.mlp.gate_proj.weight", (spec.intermediate, spec.hidden), _PROJECTION_STD
        yield f"{prefix}.mlp.up_proj.weight", (spec.intermediate, spec.hidden), _PROJECTION_STD
        yield f"{prefix}.mlp.down_proj.weight", (spec.hidden, spec.intermediate), _PROJECTION_STD
    yield "model.norm.weight", (spec.hidden,), 0.0
    yield "lm_head.weight", (spec.vocab, spec.hidden), _LM_HEAD_STD


def random_weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (fp32), drawn from a generator seeded with spec.seed."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, std in _weight_shapes(spec):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        tensors[name] = 1.0 + _NORM_NOISE_STD * noise if std == 0.0 else std * noise
    return tensors


def _write_weights(path: Path, spec: TinyModelSpec) -> None:
    from safetensors.torch import save_file

    save_file(random_weights(spec), str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors creates the file private, unlike the other files


@contextmanager
def _publish_directory(target: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty staging directory that replaces `target` when the block succeeds."""
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    if _is_non_empty_dir(target) and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Next to the target, so the final rename stays on one file system.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a model dir is not secret
        yield staging
        _replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_directory(staging: Path, target: Path) -> None:
    if not _is_non_empty_dir(target):
        # rename() replaces an empty directory in one step.
        os.replace(staging, target)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, retired)
    os.replace(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


def _is_non_empty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())
