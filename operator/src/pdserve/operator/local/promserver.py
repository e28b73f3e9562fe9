"""A Prometheus server on this machine, scraping a pool's processes: for
`pdserve local --prometheus` and for tests.

Prometheus is the real thing (Debian's package works: `scripts/ensure-prometheus.sh`
unpacks it into the project's cache). It reads its targets from a file that
`set_targets` rewrites as processes come and go (file service discovery notices at
once), binds a port the system picks, and is found there through /proc (it does not
write its port anywhere), so no port is picked and then released.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

ENV_BINARY = "PDSERVE_PROMETHEUS"
LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


class PrometheusNotFoundError(RuntimeError):
    """No Prometheus binary where pdserve looks."""


def find_binary(given: Path | None = None) -> Path:
    """Prometheus: `given`, else $PDSERVE_PROMETHEUS, else `prometheus` on PATH, else
    the one scripts/ensure-prometheus.sh unpacked into ~/.cache/pdserve."""
    if given is not None:
        return given
    if os.environ.get(ENV_BINARY):
        return Path(os.environ[ENV_BINARY])
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"
    unpacked = sorted(cache.glob("prometheus-*/root/usr/bin/prometheus"))
    if unpacked:
        return unpacked[-1]
    raise PrometheusNotFoundError(
        "no Prometheus found: install Debian's prometheus package, run "
        f"scripts/ensure-prometheus.sh, or set ${ENV_BINARY}"
    )


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (Linux: its sockets in /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        lines = path.read_text().splitlines()[1:] if path.exists() else []
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


def scrape_config(
    targets_file: Path, interval_s: float, labels: Mapping[str, str] | None = None
) -> dict[str, object]:
    """Prometheus' configuration: every target of `targets_file`, every `interval_s`."""
    interval = f"{round(interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "pdserve",
                "scrape_timeout": interval,
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
                "relabel_configs": [
                    {"target_label": key, "replacement": value}
                    for key, value in sorted((labels or {}).items())
                ],
            }
        ],
    }


class PrometheusServer:
    """A Prometheus process scraping the targets it is given."""

    def __init__(
        self,
        run_dir: Path,
        *,
        binary: Path | None = None,
        scrape_interval_s: float = 5.0,
        labels: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.run_dir = run_dir
        self.binary = find_binary(binary)
        self.scrape_interval_s = scrape_interval_s
        self.labels = dict(labels or {})
        self.host = host
        self.targets_file = run_dir / "targets.json"
        self.log_path = run_dir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """Where Prometheus answers."""
        return f"http://{self.host}:{self.port}"

    def set_targets(self, targets: Sequence[str]) -> None:
        """Scrape these host:port targets from now on (written whole, then renamed)."""
        partial = self.targets_file.with_suffix(".partial")
        partial.write_text(json.dumps([{"targets": sorted(targets), "labels": {}}]))
        partial.replace(self.targets_file)

    def start(self, targets: Sequence[str] = (), timeout_s: float = 60.0) -> str:
        """Start Prometheus and wait until it is ready; its URL."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.set_targets(targets)
        config = self.run_dir / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(scrape_config(self.targets_file, self.scrape_interval_s, self.labels))
        )
        argv = [
            str(self.binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.run_dir / 'data'}",
            f"--web.listen-address={self.host}:0",
            "--storage.tsdb.retention.time=1d",
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Prometheus exited:\n{self.log_path.read_text()}")
            ports = [] if self.port else listening_ports(self.process.pid)
            if ports:
                self.port = ports[0]
            if self.port and self._ready():
                return
            time.sleep(0.1)
        raise TimeoutError(
            f"Prometheus not ready after {timeout_s:g}s:\n{self.log_path.read_text()}"
        )

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop Prometheus (SIGTERM, then SIGKILL)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
