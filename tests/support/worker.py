"""Worker processes for tests: `pdserve worker` started for real, on loopback."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.workers import process
from pdserve.workers.process import WorkerProcess

__all__ = ["WorkerProcess", "metric", "running_worker"]


def metric(worker: WorkerProcess, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`, read from /metrics."""
    with urllib.request.urlopen(f"{worker.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{key}="{wanted}"' in series for key, wanted in labels.items()):
            total += float(value)
    return total


@contextmanager
def running_worker(model_dir: Path, log_dir: Path, *args: str) -> Iterator[WorkerProcess]:
    """A ready worker (one torch thread, so tests can run beside each other)."""
    log_path = log_dir / "worker.log"
    with process.running_worker(model_dir, log_path, ["--threads", "1", *args]) as worker:
        yield worker
