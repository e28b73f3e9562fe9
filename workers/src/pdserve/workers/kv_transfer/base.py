"""The KV transfer interface: one agent per worker, over its registered KV cache.

A transfer is a WRITE from a prefill worker's blocks into blocks a decode worker
reserved. The decode worker drives it (see docs/architecture.md, "The P/D hand-off"):

1. decode: `accept(peer)` once per prefill worker, then asks that worker to
   `connect(peer, metadata)` with its `metadata()` (agents meet; layouts checked).
2. decode: `expect(peer, blocks, transfer_id)` before asking for the prefill.
3. prefill: `write(peer, its blocks, decode's blocks, transfer_id)`, returns once
   the bytes are in the decode worker's memory.
4. decode: `PendingReceive.wait()` (returns at once where the backend writes
   one-sidedly), then adopts the blocks.

Every blocking call takes a deadline: a dead peer costs a timeout, never a hang.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.workers.kv_transfer.layout import KVLayout


def check_backend(metadata: dict[str, Any], backend: str) -> None:
    """Raise ValueError when a peer's metadata comes from another backend."""
    if metadata.get("backend") != backend:
        raise ValueError(
            f"the peer's KV transfer backend is {metadata.get('backend')!r}, this worker's "
            f"is {backend!r}: both sides must use the same one"
        )


class TransferError(RuntimeError):
    """A transfer that failed or ran out of time (the blocks' content is undefined)."""


@dataclass(frozen=True)
class TransferStats:
    """One finished transfer."""

    bytes: int
    seconds: float
    descriptors: int  # contiguous copies issued (segments x layers)


class PendingReceive(abc.ABC):
    """The decode side of one transfer."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Return once the blocks hold the sender's data; TransferError otherwise."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Give up (the blocks are about to be freed); never raises."""


class KVTransferAgent(abc.ABC):
    """A worker's end of KV transfers, over its KV cache registered once at start."""

    backend: str

    def __init__(self, name: str, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        self.name = name
        self.kv_cache = kv_cache
        self.layout = layout

    @abc.abstractmethod
    def metadata(self) -> dict[str, Any]:
        """What a peer needs to reach this agent (JSON-safe), layout included."""

    @abc.abstractmethod
    def accept(self, peer: str, timeout_s: float) -> None:
        """Decode side: get ready for prefill worker `peer` to connect (may block
        until it has; called concurrently with the request that makes it connect)."""

    @abc.abstractmethod
    def connect(self, peer: str, metadata: dict[str, Any], timeout_s: float) -> None:
        """Prefill side: reach decode worker `peer` from its metadata. Raises
        LayoutMismatchError when the caches cannot exchange blocks."""

    @abc.abstractmethod
    def expect(self, peer: str, blocks: list[int], transfer_id: str) -> PendingReceive:
        """Decode side: blocks that `peer` is about to write."""

    @abc.abstractmethod
    def write(
        self,
        peer: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        transfer_id: str,
        timeout_s: float,
    ) -> TransferStats:
        """Prefill side: copy local blocks into the peer's blocks, position by
        position; return once the data is in the peer's memory."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the agent's resources."""
