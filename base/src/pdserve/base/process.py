"""Processes on this machine that serve HTTP (workers, routers): start one, learn its
port, wait until it is ready, stop it. Used by the demo, the local pool and tests.
Standard library only, so the operator's local backend can use it without the workers.

A server is started with `--port 0 --port-file PATH` (see `pdserve.base.ports`): the
system picks the port at bind time and the server writes it down.

Each process runs in a session of its own, so a Ctrl-C in the terminal reaches only
its owner, which then stops the servers in order; on Linux the kernel also kills
them if the owner dies outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def pdserve_command(*args: str) -> list[str]:
    """The command line that runs `pdserve ARGS` with this interpreter (and so with this
    environment's installed parts): how pdserve starts its own processes."""
    return [sys.executable, "-m", "pdserve.cli", *args]


def death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that makes the kernel SIGKILL the child when its parent dies
    (Linux only; elsewhere the owner's `stop()` alone ends its children)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    parent = os.getpid()

    def set_death_signal() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return set_death_signal


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
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def log(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        """Whether the process has not exited."""
        return self.process.poll() is None

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
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def spawn(
    args: Sequence[str],
    log_path: Path,
    host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Start `pdserve ARGS --port-file PATH` (not waiting for it to be ready), with
    `env` added to this process's environment. ARGS name the host and port (0)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port_file = log_path.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    argv = pdserve_command(*args, "--port-file", str(port_file))
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=death_signal(),  # only prctl and getppid: safe after fork
        )
    return ServerProcess(process, host, port_file, log_path)


def start_server(
    command: str,
    log_path: Path,
    args: Sequence[str] = (),
    host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Start `pdserve COMMAND ARGS` listening on `host` at a port the system picks
    (not waiting for it to be ready)."""
    return spawn([command, *args, "--host", host, "--port", "0"], log_path, host, env)


def stop_all(servers: Sequence[ServerProcess], timeout_s: float = 20.0) -> None:
    """Stop servers together: SIGTERM to all first, then wait for each."""
    for server in servers:
        if server.running():
            with contextlib.suppress(ProcessLookupError):
                server.process.send_signal(signal.SIGTERM)
    for server in servers:
        server.stop(timeout_s)
