"""The machines a simulated pool runs on. A ServingPool's workers run a pod a node
(no worker shares its cores); `pdserve local` and the bench on this machine run every
worker, the router and the load generator on one machine's cores. There, each step is
stretched by the contention at its start (`costs.Contention`): the threads of the
other workers stepping meanwhile, each counted for the share of the step it overlaps,
and the CPU the router and the clients spent over the last moment."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Literal

from pdserve.workers.plan.costs import Profile

Placement = Literal["node-per-worker", "one-host"]
PLACEMENTS: tuple[Placement, ...] = ("node-per-worker", "one-host")
# The router's and the clients' CPU is spread over this window before a step.
CLIENT_WINDOW_S = 1.0

# A step's time on its host: (start, seconds alone) -> seconds.
Pace = Callable[[float, float], float]


class SharedHost:
    """One machine's cores shared by several workers, the router and the clients."""

    def __init__(self, profile: Profile, cores: int) -> None:
        self.cores = cores
        self.contention = profile.contention
        self.clients = profile.clients
        self._steps: dict[str, tuple[float, float]] = {}  # worker -> (threads, step's end)
        self._client_work: deque[tuple[float, float]] = deque()  # (when, CPU seconds)
        self._client_cpu_s = 0.0  # of the work in the window

    def pace(self, worker: str, threads: float) -> Pace:
        """The pace of `worker`'s steps, computed on `threads` threads."""
        return lambda start, alone_s: self._step(worker, threads, start, alone_s)

    def _step(self, worker: str, threads: float, start: float, alone_s: float) -> float:
        demand = threads + self._beside(worker, start, alone_s) + self.client_threads(start)
        seconds = alone_s * self.contention.stretch(demand, threads, self.cores)
        self._steps[worker] = (threads, start + seconds)
        return seconds

    def _beside(self, worker: str, start: float, alone_s: float) -> float:
        """Threads of the other workers stepping during a step from `start`, each by
        the share of the step it overlaps."""
        total = 0.0
        for other, (threads, end) in self._steps.items():
            if other == worker or end <= start:
                continue
            total += threads * (min(1.0, (end - start) / alone_s) if alone_s > 0 else 1.0)
        return total

    def request_arrived(self, now: float) -> None:
        """The router and the client took a request in."""
        self._spend(now, self.clients.per_request_s)

    def tokens_streamed(self, now: float, tokens: int) -> None:
        """The router relayed `tokens` to the client, which read them."""
        self._spend(now, self.clients.per_token_s * tokens)

    def client_threads(self, now: float) -> float:
        """The router's and the clients' CPU seconds per second over the last window."""
        while self._client_work and self._client_work[0][0] <= now - CLIENT_WINDOW_S:
            self._client_cpu_s -= self._client_work.popleft()[1]
        if not self._client_work:
            self._client_cpu_s = 0.0  # no rounding left over
        return max(0.0, self._client_cpu_s) / CLIENT_WINDOW_S

    def _spend(self, now: float, cpu_s: float) -> None:
        if cpu_s > 0:
            self._client_work.append((now, cpu_s))
            self._client_cpu_s += cpu_s


def shared_host(placement: Placement, profile: Profile) -> SharedHost | None:
    """The machine every worker shares, or None where none shares cores (a node per
    worker, or a profile that did not record the machine's cores)."""
    if placement == "one-host" and profile.cores is not None:
        return SharedHost(profile, profile.cores)
    return None
