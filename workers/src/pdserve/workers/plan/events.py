"""The simulated clock and its event queue: callbacks run in time order (ties in the
order they were scheduled), each at its time."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Callback = Callable[[float], None]


class SimClock:
    """A clock that stands still until told to move: a worker engine's `clock`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move on by `seconds` (a step that took that long)."""
        self.now += max(0.0, seconds)


class EventQueue:
    """Callbacks due at simulated times."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callback]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, when: float, callback: Callback) -> None:
        """Run `callback(when)` at `when` (never before the present)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), callback))

    def run(self, until: float | None = None) -> None:
        """Run events in order until none is left (or the next is past `until`)."""
        while self._heap:
            when = self._heap[0][0]
            if until is not None and when > until:
                return
            _, _, callback = heapq.heappop(self._heap)
            self.now = when
            callback(when)


def draw_seed(base: str, draw: int) -> str:
    """The seed of one of a simulation's draws (`simulate.DRAWS`): draw 0 keeps `base`,
    so a single simulation draws as it always did."""
    return base if draw == 0 else f"{base}#{draw}"
