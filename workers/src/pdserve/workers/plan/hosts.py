"""The machines a simulated pool runs on. A ServingPool's workers run a pod a node
(no worker shares its cores); `pdserve local` and the bench on this machine run every
worker, the router and the load generator on one machine's cores. There, the steps
running at once share the cores: each step's work (its time alone) goes at the pace
the contention of the moment allows (`costs.Contention`: the threads of every worker
stepping, and the CPU the router and the clients spent over the last moment), and
whenever a step starts or ends on the host the others' ends move accordingly. A step
that starts with others running draws its time from the spread measured with as many
workers stepping together (`Contention.drawn_spread`: a step longer than those it was
measured on draws as several), with the host's own fixed seed."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pdserve.workers.plan.costs import Profile

Placement = Literal["node-per-worker", "one-host"]
PLACEMENTS: tuple[Placement, ...] = ("node-per-worker", "one-host")
# The router's and the clients' CPU is spread over this window before a step.
CLIENT_WINDOW_S = 1.0
# The processes busy beside a pool's workers on its machine: the router and the
# load generator.
ROUTER_AND_CLIENT = 2
# The seed of the host's draws from the contention's step spread.
SPREAD_SEED = "shared-host"

# A step's time on its host, as foreseen at its start: (start, seconds alone, whether
# it carries a prompt's chunk) -> seconds.
Pace = Callable[[float, float, bool], float]
# Tells a worker that its running step now ends at this time.
Moved = Callable[[float], None]


@dataclass
class _Step:
    """A step running on the host."""

    threads: float
    work_s: float  # of its time alone, what is left
    rate: float  # of its time alone done per second now
    since: float  # when `work_s` was last brought up to date
    moved: Moved


class SharedHost:
    """One machine's cores shared by several workers, the router and the clients."""

    def __init__(self, profile: Profile, cores: int, workers: int = 1) -> None:
        self.cores = cores
        self.contention = profile.contention
        self.cost = profile.step_cost
        # Every step's time alone, as the pool's processes slow it (its workers, the
        # router and the client busy beside it: `Contention.pool_slowdown`, and for
        # a step carrying a prompt's chunk `Profile.pool_prompt_factor`), by whether
        # the step carries one.
        processes = workers + ROUTER_AND_CLIENT
        self.pool_factors = {
            False: profile.contention.pool_slowdown(processes),
            True: profile.pool_prompt_factor(processes),
        }
        self.clients = profile.clients
        self._steps: dict[str, _Step] = {}  # by worker
        self._client_work: deque[tuple[float, float]] = deque()  # (when, CPU seconds)
        self._client_cpu_s = 0.0  # of the work in the window
        self._rng = random.Random(SPREAD_SEED)

    def pace(self, worker: str, threads: float, moved: Moved) -> Pace:
        """The pace of `worker`'s steps on `threads` threads; `moved` is told when a
        running step's end moves."""

        def started(start: float, alone_s: float, prompt: bool) -> float:
            self._settle(start)
            spread = self.contention.drawn_spread(len(self._steps) + 1, self.cost)
            work_s = alone_s * self.pool_factors[prompt] * spread.draw(self._rng, alone_s)
            step = _Step(threads, work_s, 1.0, start, moved)
            self._steps[worker] = step
            self._rerate(start, started=worker)
            return step.work_s / step.rate

        return started

    def ended(self, worker: str, now: float) -> None:
        """`worker`'s step is over: the others go faster."""
        self._settle(now)
        self._steps.pop(worker, None)
        self._rerate(now)

    def _settle(self, now: float) -> None:
        """Bring every running step's work up to `now`."""
        for step in self._steps.values():
            step.work_s = max(0.0, step.work_s - (now - step.since) * step.rate)
            step.since = now

    def _rerate(self, now: float, started: str | None = None) -> None:
        """Every step's pace under the contention now; the ends that move are told."""
        demand = sum(step.threads for step in self._steps.values()) + self.client_threads(now)
        for worker, step in self._steps.items():
            rate = 1.0 / self.contention.stretch(demand, step.threads, self.cores)
            if rate == step.rate:
                continue
            step.rate = rate
            if worker != started:
                step.moved(now + step.work_s / rate)

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


def shared_host(placement: Placement, profile: Profile, workers: int = 1) -> SharedHost | None:
    """The machine every one of the pool's `workers` shares, or None where none shares
    cores (a node per worker, or a profile that did not record the machine's cores)."""
    if placement == "one-host" and profile.cores is not None:
        return SharedHost(profile, profile.cores, workers)
    return None
