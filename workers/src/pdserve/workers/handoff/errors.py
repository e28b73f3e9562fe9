"""Why a hand-off failed, in a form the decode worker can act on and report."""

from __future__ import annotations


class HandoffError(RuntimeError):
    """A hand-off that did not deliver the prompt's KV. `code` names the cause for
    metrics and error bodies: connect_failed, layout_mismatch, no_blocks,
    prefill_failed, transfer_failed, lease_expired, unknown_peer, bad_handoff."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
