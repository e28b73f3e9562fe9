"""Waiting for an eventual condition, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | Literal[False] | None], timeout: float, what: str, interval: float = 0.1
) -> T:
    """Poll `check` until it returns something truthy (so neither None nor False); fail
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
