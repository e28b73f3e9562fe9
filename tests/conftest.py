"""Shared fixtures: small generated checkpoints (written once per session)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint
from support.llama_tokenizer import write_llama_checkpoint

# Tests share two cores with worker processes they start: one torch thread each keeps
# OpenMP from spinning against them.
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files marked `starts_first` go to the front (in their order): the test processes
    take files in this order, and the longest started last would end the run alone."""
    items.sort(key=lambda item: item.get_closest_marker("starts_first") is None)


# Small enough for many engine instances per test run, big enough for GQA and chunking
# to matter (two layers, 4 query heads over 2 KV heads).
SMALL_SPEC = TinyModelSpec(
    layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024, max_position=2048
)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama checkpoint with its tokenizer."""
    directory = tmp_path_factory.mktemp("models") / "small-llama"
    write_tiny_checkpoint(directory, SMALL_SPEC)
    return directory


@pytest.fixture(scope="session")
def other_weights_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model's architecture with other weights (another seed): what a
    rolling update to a fine-tuned checkpoint looks like to a worker."""
    directory = tmp_path_factory.mktemp("models") / "small-llama-other"
    write_tiny_checkpoint(directory, dataclasses.replace(SMALL_SPEC, seed=SMALL_SPEC.seed + 1))
    return directory


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model with a Llama-2-style (SentencePiece, byte-fallback) tokenizer in
    place of its byte-level one: where tokenization matters, both are tested."""
    return write_llama_checkpoint(tmp_path_factory.mktemp("models") / "small-llama2", SMALL_SPEC)
