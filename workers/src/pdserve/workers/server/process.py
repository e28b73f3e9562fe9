"""Worker processes on this machine, for the demo and tests (the process handling
itself is `pdserve.base.process`, shared with the operator's local backend)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from pdserve.base.process import ServerProcess, spawn, start_server

__all__ = [
    "ServerProcess",
    "running_worker",
    "spawn",
    "start_server",
    "start_worker",
]


def start_worker(
    model_dir: Path,
    log_path: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Start `pdserve worker` on a model (not waiting for it to be ready)."""
    return start_server("worker", log_path, ["--model", str(model_dir), *args], env=env)


@contextmanager
def running_worker(
    model_dir: Path,
    log_path: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """A ready worker for the duration of a `with` block."""
    worker = start_worker(model_dir, log_path, args, env=env)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()
