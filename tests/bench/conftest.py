"""Benchmarks run on the default tiny model (the demo's), written once and cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli.demo import DEFAULT_MODEL_DIR, ensure_tiny_model
from pdserve.workers.model.checkpoint import TinyModelSpec, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    ensure_tiny_model(DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR


# A random Llama whose prefill is the bulk of a request's time on two CPU cores (about
# 6x the tiny model's work per token), for comparisons that hinge on prefill cost.
PREFILL_HEAVY_SPEC = TinyModelSpec(
    layers=6, hidden=512, heads=8, kv_heads=2, intermediate=1408, vocab=4096, max_position=16384
)
PREFILL_HEAVY_DIR = DEFAULT_MODEL_DIR.parent / "prefill-heavy-llama"


@pytest.fixture(scope="session")
def prefill_heavy_model_dir() -> Path:
    """The prefill-heavy model, written once and cached beside the tiny one."""
    if not (PREFILL_HEAVY_DIR / "config.json").is_file():
        write_tiny_checkpoint(PREFILL_HEAVY_DIR, PREFILL_HEAVY_SPEC, overwrite=True)
    return PREFILL_HEAVY_DIR
