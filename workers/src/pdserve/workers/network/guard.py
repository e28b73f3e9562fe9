"""The network limits of one server and what they count: the connections open, the
bodies being received, and the metric of every refusal. Both servers make one at
start-up, put its middleware (`bodies.guard_middleware`) innermost in their
application, and listen with it (`site.listen`). It sits below the protocol
(`connection`) and the middleware (`bodies`) that enforce it, and imports neither."""

from __future__ import annotations

from pdserve.workers.network.limits import NetworkLimits
from pdserve.workers.network.metrics import NetworkMetrics


class NetworkGuard:
    """The deadlines and caps of one server, shared by its connections."""

    def __init__(self, limits: NetworkLimits, metrics: NetworkMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.connections = 0  # admitted and open
        self.body_reads = 0  # request bodies being received

    def open_connection(self) -> bool:
        """Admit a new connection: False (counted) past the cap."""
        if self.connections >= self.limits.limit_concurrency:
            self.metrics.refused("connection_limit")
            return False
        self.connections += 1
        self.metrics.set_connections(self.connections)
        return True

    def close_connection(self) -> None:
        """An admitted connection closed."""
        self.connections -= 1
        self.metrics.set_connections(self.connections)
