"""A circuit breaker per worker: after a few failures in a row a worker gets no
traffic for a while, then one trial request (or a successful load probe) decides
whether it is back. A worker that keeps failing waits longer each time, up to a cap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Closed: traffic flows. Open: none, for `cooldown`. Half-open: one trial at a time."""

    def __init__(
        self,
        threshold: int = 3,
        cooldown_s: float = 2.0,
        max_cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._cooldown_s = cooldown_s
        self._trial = False
        # Answers seen from the worker, ever: a probe that timed out while this moved
        # met a slow worker, not a dead one.
        self.answers = 0

    @property
    def state(self) -> State:
        """The breaker's state now."""
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at < self._cooldown_s:
            return "open"
        return "half_open"

    def available(self) -> bool:
        """Whether the worker may be sent a request now."""
        if self._opened_at is None:  # closed: asked for every worker, every request
            return True
        state = self.state
        return state == "closed" or (state == "half_open" and not self._trial)

    def dispatched(self) -> None:
        """A request was sent; in half-open it is the trial."""
        if self._opened_at is not None and self.state == "half_open":
            self._trial = True

    def succeeded(self) -> None:
        """A request (or a probe after the cooldown) succeeded: close."""
        self.answers += 1
        if self._opened_at is None and not self._failures and not self._trial:
            return  # closed, nothing to forget
        if self.state == "open":
            return  # a probe during the cooldown proves too little
        self._failures = 0
        self._opened_at = None
        self._cooldown_s = self.base_cooldown_s
        self._trial = False

    def failed(self) -> None:
        """A request or probe failed: open after `threshold` in a row, or at once when
        the trial fails (with a longer cooldown)."""
        state = self.state
        self._trial = False
        if state == "half_open":
            self._cooldown_s = min(self._cooldown_s * 2, self.max_cooldown_s)
            self._opened_at = self._clock()
            return
        if state == "open":
            return
        self._failures += 1
        if self._failures >= self.threshold:
            self._opened_at = self._clock()
