"""Choosing a KV transfer backend by name."""

from __future__ import annotations

import sys

import pytest
import torch

from pdserve.workers.kv_transfer.factory import create_agent
from pdserve.workers.kv_transfer.layout import KVLayout

CACHE = torch.zeros((2, 4, 2, 4, 2, 8))
LAYOUT = KVLayout.of(CACHE, model="m", weights="w")


def test_an_unknown_backend_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown KV transfer backend 'mooncake'; known: nixl"):
        create_agent("mooncake", "w", CACHE, LAYOUT)


def test_nixl_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a machine without the package: importing the backend fails.
    monkeypatch.setitem(sys.modules, "pdserve.workers.kv_transfer.nixl", None)
    with pytest.raises(RuntimeError, match=r"needs the NIXL Python package \(pip install"):
        create_agent("nixl", "w", CACHE, LAYOUT)


def test_the_torch_backend_publishes_its_store_on_the_given_host() -> None:
    agent = create_agent("torch", "w", CACHE, LAYOUT, host="127.0.0.1")
    try:
        metadata = agent.metadata()
        assert metadata["backend"] == "torch" and metadata["store_host"] == "127.0.0.1"
        assert KVLayout.from_json(metadata["layout"]) == LAYOUT
    finally:
        agent.close()
