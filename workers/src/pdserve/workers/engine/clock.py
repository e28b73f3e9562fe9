"""The engine's clock: `time.monotonic` when serving; a simulated clock when the
planner runs the engine's own scheduling on a step-cost profile."""

from __future__ import annotations

from collections.abc import Callable

# Seconds, monotonic: what `time.monotonic` returns.
Clock = Callable[[], float]
