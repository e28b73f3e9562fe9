"""What the hand-off reports as it goes: the worker's metrics implement this, so the
hand-off does not depend on the server that hosts it."""

from __future__ import annotations

from typing import Protocol

from pdserve.workers.kv_transfer.base import TransferStats


class HandoffObserver(Protocol):
    """Receives the outcome of each hand-off."""

    def observe_transfer(self, stats: TransferStats) -> None:
        """A KV transfer finished."""

    def observe_transfer_failure(self, reason: str) -> None:
        """A hand-off failed; `reason` is one of the codes in `handoff.errors`."""

    def observe_kv_reused(self, blocks: int, num_bytes: int) -> None:
        """Decode side: blocks of a handed-off prompt already in this worker's prefix
        cache, which the hand-off did not move."""

    def observe_kv_wait(self, seconds: float) -> None:
        """Decode side: how long a request waited for its KV."""

    def observe_room_wait(self, seconds: float) -> None:
        """Decode side: how long a hand-off that found too few free blocks for its
        prompt waited for requests here to free them."""

    def observe_handoff_skipped(self) -> None:
        """Decode side: a prompt this worker's prefix cache held but the few tokens
        the pool serves colocated was computed here, without a hand-off."""

    def observe_peers(self, count: int) -> None:
        """How many peers the transfer agent holds connections to now."""
