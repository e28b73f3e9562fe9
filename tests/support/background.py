"""A test's helper that works on a thread of its own while the test drives the system."""

from __future__ import annotations

import threading
from typing import Self


class Background:
    """Runs `run` on a daemon thread from `with` until its block ends: `stopping` is
    set then, and the thread joined (so what it recorded is complete once the block is
    left). Subclasses define `run`, which should return soon after `stopping` is set."""

    def __init__(self, name: str) -> None:
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)

    def run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self._thread.join()
