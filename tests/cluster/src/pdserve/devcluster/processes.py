"""Child processes that cannot outlive the Python process that started them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.base.process import death_signal


class ManagedProcess:
    """One server process: its own process group, output in a log file, killed with us."""

    def __init__(
        self, name: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log = log
        self._env = env
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the process; output (stdout and stderr) goes to the log file."""
        with self.log.open("ab") as out:
            # A new session keeps Ctrl-C in the terminal from reaching the servers
            # directly: the owner stops them in order instead. The death signal covers
            # the owner being killed outright.
            self._popen = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
                # Safe here: the hook only calls prctl and getppid.
                preexec_fn=death_signal(),
            )

    @property
    def pid(self) -> int | None:
        """The process id, once started."""
        return self._popen.pid if self._popen else None

    def exit_code(self) -> int | None:
        """None while running (or never started), else the exit status."""
        return self._popen.poll() if self._popen else None

    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self._popen is not None and self._popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the process's output, for error messages."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout` seconds."""
        if self._popen is None or self._popen.poll() is not None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self._popen.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, sig)


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    watch: Sequence[ManagedProcess] = (),
    interval: float = 0.2,
) -> None:
    """Poll `check` until it is true; fail early when a watched process exits."""
    deadline = time.monotonic() + timeout
    while not check():
        for process in watch:
            code = process.exit_code()
            if code is not None:
                raise RuntimeError(
                    f"{process.name} exited with status {code} while waiting for {what}; "
                    f"log {process.log}:\n{process.log_tail()}"
                )
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name} ({p.log}):\n{p.log_tail(10)}" for p in watch)
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        time.sleep(interval)
