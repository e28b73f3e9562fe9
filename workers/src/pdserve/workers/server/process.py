"""Processes on this machine that serve HTTP (workers, routers): start one, learn its
port, wait until it is ready, stop it. Used by the demo, the local pool and tests.

A process is started with `--port 0 --port-file PATH` (see `pdserve.cli.ports`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from pdserve.cli.main import pdserve_command


def listening_port(runner: web.AppRunner) -> int:
    """The port an aiohttp runner's (first) site listens on."""
    return int(runner.addresses[0][1])


@dataclass
class ServerProcess:
    """A running `pdserve` server process and where to reach it."""

    process: subprocess.Popen[bytes]
    host: str
    port_file: Path
    log_path: Path
    port: int = 0

    @property
    def url(self) -> str:
        """http://host:port, once the port is known (see `wait_listening`)."""
        if not self.port:
            self.wait_listening()
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout_s: float = 180.0) -> int:
        """The port, once the process has written it; raise with its log if it dies or
        the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not self.port:
            self._check_alive()
            try:
                self.port = int(self.port_file.read_text())
            except (FileNotFoundError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no port after {timeout_s:.0f}s:\n{self.log()}") from None
                time.sleep(0.05)
        return self.port

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Poll /ready until it answers 200; raise with the log if the process dies or
        the time runs out."""
        deadline = time.monotonic() + timeout_s
        self.wait_listening(timeout_s)
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"not ready after {timeout_s:.0f}s:\n{self.log()}")

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"exited with status {self.process.returncode}:\n{self.log()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    command: str,
    log_path: Path,
    args: Sequence[str] = (),
    host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Start `pdserve COMMAND ARGS` listening on a port the system picks (not waiting
    for it to be ready), with `env` added to this process's environment."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port_file = log_path.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    argv = pdserve_command(
        command, *args, "--host", host, "--port", "0", "--port-file", str(port_file)
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    return ServerProcess(process, host, port_file, log_path)


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
