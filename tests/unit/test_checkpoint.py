"""`pdserve model init` and the random tiny checkpoints it writes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM

from pdserve.workers.engine.config import ConfigError
from pdserve.workers.model import checkpoint, checkpoint_cli
from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint
from pdserve.workers.model.identity import weights_digest

# Smaller than the default, for the tests that write several checkpoints.
SPEC = TinyModelSpec(
    layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, max_position=512
)


@pytest.fixture(scope="module")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model, as `pdserve model init --tiny` writes it."""
    directory = tmp_path_factory.mktemp("default") / "tiny"
    write_tiny_checkpoint(directory, TinyModelSpec())
    return directory


@pytest.fixture(scope="module")
def default_model(default_model_dir: Path) -> Any:
    loaded: Any = AutoModelForCausalLM.from_pretrained(default_model_dir, output_loading_info=True)
    model, info = loaded
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    return model.eval()


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_default_config_describes_a_grouped_query_llama(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (4, 256)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    assert (config["head_dim"], config["intermediate_size"]) == (32, 704)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (4096, 16384)
    assert config["tie_word_embeddings"] is False
    tokenizer = tokenizers.Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    assert config["vocab_size"] >= tokenizer.get_vocab_size()
    end_ids = [tokenizer.token_to_id(name) for name in ("<|end_of_text|>", "<|eot_id|>")]
    assert config["eos_token_id"] == end_ids
    assert config["bos_token_id"] == tokenizer.token_to_id("<|begin_of_text|>")


def test_transformers_loads_every_weight(default_model: Any) -> None:
    parameters = sum(p.numel() for p in default_model.parameters())
    assert parameters == TinyModelSpec().parameter_count()
    layer = default_model.model.layers[0]
    assert layer.self_attn.k_proj.weight.shape == (2 * 32, 256)
    norm = layer.input_layernorm.weight.detach()
    # Norm weights sit near 1 but vary, so a misapplied norm changes the logits.
    assert 0.9 < float(norm.mean()) < 1.1 and float(norm.std()) > 0.01


@pytest.fixture
def one_thread() -> Iterator[None]:
    """A model this small runs faster on one thread than on busy shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_greedy_outputs_vary_and_depend_on_context(default_model: Any) -> None:
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 4000, (1, 24), generator=generator)
    other_start = prompt.clone()
    other_start[0, :12] = torch.randint(0, 4000, (12,), generator=generator)
    outputs = []
    for ids in (prompt, other_start):
        with torch.no_grad():
            generated = default_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
            )
        outputs.append(generated[0, ids.shape[1] :].tolist())
    assert len(set(outputs[0])) > 12
    # Only the earlier half of the prompt differs: attention must carry it.
    assert outputs[0] != outputs[1]


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path / "a", SPEC)
    write_tiny_checkpoint(tmp_path / "b", SPEC)
    write_tiny_checkpoint(tmp_path / "c", TinyModelSpec(**{**SPEC.__dict__, "seed": 1}))
    first, second, other_seed = (_files(tmp_path / name) for name in "abc")
    assert first == second
    assert set(first) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert other_seed["model.safetensors"] != first["model.safetensors"]


def test_failed_write_leaves_no_partial_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(path: Path, spec: TinyModelSpec) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_weights", fail)
    with pytest.raises(OSError, match="disk full"):
        write_tiny_checkpoint(tmp_path / "model", SPEC)
    assert list(tmp_path.iterdir()) == []


def test_invalid_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        TinyModelSpec(heads=8, kv_heads=3)
    with pytest.raises(ValueError, match="vocab"):
        TinyModelSpec(vocab=100)


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    checkpoint_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    code: int = args.handler(args)
    return code


_SMALL_FLAGS = (
    *("--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "1"),
    *("--intermediate", "96", "--vocab", "512", "--max-position", "256"),
)


def test_cli_writes_a_model_and_reports_its_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "model"
    assert _run_cli("model", "init", "--tiny", str(directory), *_SMALL_FLAGS) == 0
    out = capsys.readouterr().out
    spec = TinyModelSpec(
        layers=1, hidden=64, heads=4, kv_heads=1, intermediate=96, vocab=512, max_position=256
    )
    assert str(directory) in out and f"{spec.parameter_count():,}" in out
    config = json.loads((directory / "config.json").read_text())
    assert (config["num_key_value_heads"], config["max_position_embeddings"]) == (1, 256)


def test_cli_refuses_a_non_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    assert _run_cli("model", "init", "--tiny", str(tmp_path), *_SMALL_FLAGS) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert _run_cli("model", "init", "--tiny", "--force", str(tmp_path), *_SMALL_FLAGS) == 0
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "notes.txt").exists()


def test_cli_explains_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli("model", "init", str(tmp_path / "m")) == 2
    assert "--tiny" in capsys.readouterr().err
    assert _run_cli("model", "init", "--tiny", "--heads", "3", str(tmp_path / "m")) == 2
    assert "multiple of heads" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_the_weights_digest_tells_checkpoints_apart_cheaply(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_tiny_checkpoint(first, SPEC)
    write_tiny_checkpoint(second, dataclasses.replace(SPEC, seed=SPEC.seed + 1))
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)

    assert weights_digest(first) == weights_digest(copy)
    assert weights_digest(first) != weights_digest(second)  # same shapes, other values
    weights = copy / "model.safetensors"
    (header_bytes,) = struct.unpack("<Q", weights.read_bytes()[:8])
    with weights.open("r+b") as file:  # one value of the first tensor changes
        file.seek(8 + header_bytes)
        file.write(b"\x00\x00\x80\x7f")
    assert weights_digest(copy) != weights_digest(first)
    weights.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        weights_digest(copy)
