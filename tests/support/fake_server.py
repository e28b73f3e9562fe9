"""The load generator's scripted fake server, in a process of its own (so that its CPU
is not counted in the test's)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fake_server(*options: str) -> Iterator[str]:
    """A running fake server (options: see `pdserve.workers.bench.fake_server`); its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.workers.bench.fake_server", "--port", "0", *options],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip()
    finally:
        process.terminate()
        process.wait(10)
