"""What the worker's and the router's metrics share: the latency buckets and the `reason`
label of an error answer, so a dashboard reads both servers the same way."""

from __future__ import annotations

from pdserve.protocol.api_errors import APIError
from pdserve.workers.network.bodies import TOO_MANY_BODY_READS, TOO_MANY_CONNECTIONS

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def rejection_reason(error: APIError) -> str:
    """The `reason` label of an error answer: a small fixed set, whatever the error."""
    if error.code in _REASONS:
        return _REASONS[str(error.code)]
    if error.status == 404:
        return "not_found"
    if error.status == 413:
        return "too_large"
    if 400 <= error.status < 500:
        return "invalid"
    if error.status == 502:
        return "handoff_failed"
    return "internal"


_REASONS = {
    "queue_full": "queue_full",
    "queue_timeout": "queue_timeout",
    "engine_stopped": "engine_stopped",
    "request_failed": "request_failed",
    TOO_MANY_CONNECTIONS: "connection_limit",
    TOO_MANY_BODY_READS: "body_read_limit",
    "body_timeout": "body_timeout",
}
