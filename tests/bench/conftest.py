"""Benchmarks run on the default tiny model (the demo's), written once and cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli.demo import DEFAULT_MODEL_DIR, ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    ensure_tiny_model(DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR
