"""Worker processes on this machine: start `pdserve worker`, wait until it is ready,
stop it. Used by the demo and tests, and the base of the local pool."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class WorkerProcess:
    """A running worker and where to reach it."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        """Everything the worker printed so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Poll /ready until it answers 200; raise with the worker's log if the process
        dies or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"worker exited with status {self.process.returncode}:\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"worker not ready after {timeout_s:.0f}s:\n{self.log()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_worker(model_dir: Path, log_path: Path, args: Sequence[str] = ()) -> WorkerProcess:
    """Start `pdserve worker` on a free loopback port (not waiting for it)."""
    port = free_port()
    command = [
        sys.executable, "-m", "pdserve", "worker", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return WorkerProcess(process, f"http://127.0.0.1:{port}", log_path)


@contextmanager
def running_worker(
    model_dir: Path, log_path: Path, args: Sequence[str] = ()
) -> Iterator[WorkerProcess]:
    """A ready worker for the duration of a `with` block."""
    worker = start_worker(model_dir, log_path, args)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()
