"""Build a worker's transfer agent from the backend named in its pool's spec."""

from __future__ import annotations

import torch

from pdserve.workers.kv_transfer.base import MAX_PEERS, KVTransferAgent
from pdserve.workers.kv_transfer.layout import KVLayout

BACKENDS = ("nixl", "torch")


def create_agent(
    backend: str,
    name: str,
    kv_cache: torch.Tensor,
    layout: KVLayout,
    host: str = "127.0.0.1",
    max_peers: int = MAX_PEERS,
) -> KVTransferAgent:
    """The agent of `backend` over `kv_cache`, registered once. `host` is the address
    peers reach this worker on (the torch backend's store and gloo listen there; UCX
    chooses its own interfaces); `max_peers` bounds its connections. ValueError for
    an unknown backend; RuntimeError when the backend's library cannot be loaded."""
    if backend == "nixl":
        try:
            from pdserve.workers.kv_transfer.nixl import NixlAgent
        except ImportError as error:
            raise RuntimeError(
                "the KV transfer backend 'nixl' needs the NIXL Python package "
                f"(pip install 'pdserve[nixl]'), which could not be imported: {error}"
            ) from error
        return NixlAgent(name, kv_cache, layout, max_peers)
    if backend == "torch":
        from pdserve.workers.kv_transfer.torch_dist import TorchDistAgent

        return TorchDistAgent(name, kv_cache, layout, host=host, max_peers=max_peers)
    raise ValueError(f"unknown KV transfer backend {backend!r}; known: {', '.join(BACKENDS)}")
