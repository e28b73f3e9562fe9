"""Worker processes for tests: `pdserve worker` started for real, on loopback."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pdserve.workers.faults import Fault, environment
from pdserve.workers.server import process
from pdserve.workers.server.process import ServerProcess
from support.prom import total
from support.waiting import wait_until

__all__ = ["ServerProcess", "metric", "running_worker", "wait_engine_emptied"]


def metric(worker: ServerProcess, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`, read from /metrics."""
    return total(f"{worker.url}/metrics", name, **labels)


def wait_engine_emptied(worker: ServerProcess, timeout_s: float = 60) -> None:
    """Wait until the worker's engine holds nothing: no KV cache in use, no request
    running."""
    wait_until(
        lambda: metric(worker, "pdserve_kv_cache_usage_ratio") == 0.0
        and metric(worker, "pdserve_requests_running") == 0,
        timeout_s, "the worker's engine to hold no request",
    )  # fmt: skip


@contextmanager
def running_worker(
    model_dir: Path,
    log_dir: Path,
    *args: str,
    faults: Mapping[str, Fault | list[Fault]] | None = None,
) -> Iterator[ServerProcess]:
    """A ready worker (one torch thread, so tests can run beside each other), with
    `faults` injected (see `pdserve.workers.faults`)."""
    log_path = log_dir / "worker.log"
    env = environment(faults) if faults else None
    with process.running_worker(model_dir, log_path, ["--threads", "1", *args], env) as worker:
        yield worker
