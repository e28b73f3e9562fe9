"""Why a hand-off failed, in a form the decode worker can act on and report."""

from __future__ import annotations

# Every cause a hand-off can fail for. They label a metric and travel between
# workers, so they are a closed set: whatever else a peer sends becomes `PEER_FAILED`.
CODES = frozenset(
    {
        "connect_failed",  # the workers could not meet (HTTP or transfer agents)
        "layout_mismatch",  # their KV caches (or model weights) differ
        "no_blocks",  # the decode worker had no free blocks to reserve
        "prefill_failed",  # the prefill worker failed or did not answer
        "transfer_failed",  # the KV bytes did not arrive
        "lease_expired",  # a deadline passed before the KV was in place
        "unknown_peer",  # the prefill worker does not know the pair (met again)
        "bad_handoff",  # a malformed or inconsistent hand-off request or answer
        "cancelled",  # the decode worker withdrew the hand-off
    }
)
PEER_FAILED = "prefill_failed"


def known_code(code: object) -> str:
    """`code` if it is one of `CODES`, else `PEER_FAILED`: a peer's words never become
    a new label value."""
    return code if isinstance(code, str) and code in CODES else PEER_FAILED


class HandoffError(RuntimeError):
    """A hand-off that did not deliver the prompt's KV. `code` (one of `CODES`) names
    the cause for metrics and error bodies."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = known_code(code)
