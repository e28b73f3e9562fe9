"""The KV transfer interface: one agent per worker, over its registered KV cache.

A transfer is a WRITE from a prefill worker's blocks into blocks a decode worker
reserved. The decode worker drives it (see docs/architecture.md, "The P/D hand-off"):

1. decode: `accept(peer)` once per prefill worker, then asks that worker to
   `connect(peer, metadata)` with its `metadata()` (agents meet; layouts checked).
2. decode: `expect(peer, blocks, transfer_id)` before asking for the prefill.
3. prefill: `write(peer, its blocks, decode's blocks, transfer_id)`, returns once
   the bytes are in the decode worker's memory; or, when it will not write after
   all, `decline(...)`, so that receives the decode side posted complete.
4. decode: `PendingReceive.wait()` (returns at once where the backend writes
   one-sidedly), then adopts the blocks; or, giving up, `withdraw()`, which says
   whether it can guarantee that nothing more lands in them.

Every blocking call takes a deadline: a dead peer costs a timeout, never a hang. A
deadline already past fails at once (it never means "no timeout"). Peers are kept
in a bounded table: a peer that meets again replaces its old connection, and the
least recently used idle peer makes room for a new one.
"""

from __future__ import annotations

import abc
import threading
import time
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


# Peers an agent keeps connections to at most (pairs on the prefill side).
MAX_PEERS = 128


class TransferError(RuntimeError):
    """A transfer that failed or ran out of time (the blocks' content is undefined)."""


class NotConnectedError(TransferError):
    """A transfer over a pair this agent does not hold (never met, or dropped)."""


def seconds_left(deadline: float, what: str) -> float:
    """Seconds until `deadline` (time.monotonic()); TransferError once it has passed,
    so that a spent budget never reaches an API where 0 means "wait forever"."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(f"{what}: its deadline has passed")
    return left


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
    def withdraw(self, timeout_s: float) -> bool:
        """Give up: make sure nothing more of this transfer lands in its blocks,
        waiting up to `timeout_s` for the sender to finish or stop. True once that is
        certain (the receive completed or failed, or was withdrawn); False where only
        the sender can stop (a one-sided write): then the sender's word, or the
        lease's end, must do. Never raises."""


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
        cancelled: threading.Event | None = None,
    ) -> TransferStats:
        """Prefill side: copy local blocks into the peer's blocks, position by
        position; return once the data is in the peer's memory. `cancelled` set
        stops the write as soon as the backend can (TransferError)."""

    @abc.abstractmethod
    def decline(
        self, peer: str, remote_blocks: list[int], transfer_id: str, timeout_s: float
    ) -> None:
        """Prefill side: this transfer will carry no data. Where the receiver posted
        receives for it (torch), fill them so they complete (the receiver never
        adopts them); nothing to do for a one-sided write."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Drop the connection to `peer` (transfers still running on it fail);
        never raises."""

    @abc.abstractmethod
    def is_connected(self, peer: str) -> bool:
        """Whether transfers with `peer` can go ahead (it met, and was not dropped)."""

    @abc.abstractmethod
    def num_peers(self) -> int:
        """Connections this agent holds now."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the agent's resources."""
