"""Build a worker's transfer agent from the backend named in its pool's spec."""

from __future__ import annotations

import torch

from pdserve.workers.kv_transfer.base import KVTransferAgent
from pdserve.workers.kv_transfer.layout import KVLayout

BACKENDS = ("nixl", "torch")


def create_agent(
    backend: str, name: str, kv_cache: torch.Tensor, layout: KVLayout, host: str = "127.0.0.1"
) -> KVTransferAgent:
    """The agent of `backend` over `kv_cache`, registered once. `host` is the address
    peers reach this worker on (the torch backend's store and gloo listen there; UCX
    chooses its own interfaces). ValueError for an unknown backend; RuntimeError when
    the backend's library cannot be loaded."""
    if backend == "nixl":
        try:
            from pdserve.workers.kv_transfer.nixl import NixlAgent
        except ImportError as error:
            raise RuntimeError(
                "the KV transfer backend 'nixl' needs the NIXL Python package "
                f"(pip install 'pdserve[nixl]'), which could not be imported: {error}"
            ) from error
        return NixlAgent(name, kv_cache, layout)
    if backend == "torch":
        from pdserve.workers.kv_transfer.torch_dist import TorchDistAgent

        return TorchDistAgent(name, kv_cache, layout, host=host)
    raise ValueError(f"unknown KV transfer backend {backend!r}; known: {', '.join(BACKENDS)}")
