"""The metrics of the network limits, in the server's own registry: every connection
or request refused or cut off, by reason, and the connections open."""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

Refusal = Literal[
    "connection_limit", "body_read_limit", "header_timeout", "body_timeout", "write_timeout"
]


class NetworkMetrics:
    """`pdserve_http_connections_rejected_total{reason}` and `pdserve_http_connections`."""

    def __init__(self, registry: CollectorRegistry, pool: str, role: str) -> None:
        self._labels = {"pool": pool, "role": role}
        names = ("pool", "role")
        self.rejected = Counter(
            "pdserve_http_connections_rejected_total",
            "Connections refused or cut off by the network limits, by reason: "
            "connection_limit (503, --limit-concurrency), body_read_limit (503, "
            "--limit-body-reads), header_timeout, body_timeout (408) and write_timeout "
            "(a client that stopped reading its answer).",
            (*names, "reason"), registry=registry,
        )  # fmt: skip
        self.connections = Gauge(
            "pdserve_http_connections",
            "Client connections open (within --limit-concurrency).",
            names, registry=registry,
        )  # fmt: skip

    def refused(self, reason: Refusal) -> None:
        """Count one refusal."""
        self.rejected.labels(**self._labels, reason=reason).inc()

    def set_connections(self, count: int) -> None:
        """The connections open now."""
        self.connections.labels(**self._labels).set(count)
