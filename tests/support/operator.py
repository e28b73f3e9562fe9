"""Running `pdserve operator` as a real process against the dev cluster, for tests.

The operator runs under the ServiceAccount of deploy/operator/rbac.yaml (a token
kubeconfig), so the tests also prove that manifest grants enough.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from pdserve.cli.main import pdserve_command
from support import prom
from support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "deploy" / "operator" / "rbac.yaml"
CRDS = ROOT / "crds"
OPERATOR_NAMESPACE = "pdserve-system"
OPERATOR_ACCOUNT = "pdserve-operator"
POOL_LABEL = "pdserve.dev/pool"


class Cluster(Protocol):
    """The part of the dev cluster these helpers use."""

    @property
    def kubeconfig(self) -> Path: ...

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]: ...


def install_crd(cluster: Cluster) -> None:
    """Apply crds/ and wait until the API server serves ServingPools."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/servingpools.pdserve.dev"
    )


def operator_kubeconfig(cluster: Cluster, path: Path) -> Path:
    """A kubeconfig for the operator's ServiceAccount (deploy/operator/rbac.yaml)."""
    if cluster.kubectl("get", "namespace", OPERATOR_NAMESPACE, check=False).returncode:
        cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    cluster.kubectl("apply", "-f", str(RBAC))
    return account_kubeconfig(cluster, OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, path)


def account_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that acts as a ServiceAccount (a token the API server issues)."""
    token = cluster.kubectl(
        "create", "token", account, "-n", namespace, "--duration=6h"
    ).stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    context = {"cluster": admin["clusters"][0]["name"], "user": account}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": context}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class OperatorProcess:
    """`pdserve operator` in a child process, with its /metrics."""

    def __init__(self, kubeconfig: Path, log: Path, namespaces: Sequence[str] = ()) -> None:
        self.kubeconfig = kubeconfig
        self.log = log
        self.namespaces = tuple(namespaces)
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The process id (the operator must be running)."""
        assert self._process is not None, "operator not started"
        return self._process.pid

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        """Start the operator and wait until it serves /metrics."""
        scope = [arg for ns in self.namespaces for arg in ("--namespace", ns)] or ["-A"]
        port_file = self.log.with_suffix(".port")
        port_file.unlink(missing_ok=True)
        command = pdserve_command("operator", *scope, "--kubeconfig", str(self.kubeconfig))
        command += ["--metrics-host", "127.0.0.1", "--metrics-port", "0"]
        command += ["--port-file", str(port_file)]
        self.port = 0
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.log.parent
            )
        wait_until(lambda: self._listening(port_file), timeout, "the operator's port file")
        wait_until(self._serving, timeout, f"operator /metrics on port {self.port}")
        return self

    def _listening(self, port_file: Path) -> bool:
        self._check_alive()
        try:
            self.port = int(port_file.read_text())
        except (FileNotFoundError, ValueError):
            return False
        return True

    def _check_alive(self) -> None:
        assert self._process is not None
        if self._process.poll() is not None:
            raise AssertionError(f"operator exited ({self._process.returncode}):\n{self.tail()}")

    def _serving(self) -> bool:
        self._check_alive()
        try:
            self.metrics()
        except OSError:
            return False
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the operator as Kubernetes would (SIGTERM, then SIGKILL)."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def restart(self) -> OperatorProcess:
        """Stop, then start a fresh process (a new metrics port too)."""
        self.stop()
        return self.start()

    def healthy(self) -> bool:
        """Whether the liveness probe (/healthz) answers 200."""
        url = f"http://127.0.0.1:{self.port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status) == 200
        except OSError:
            return False

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """The operator's samples."""
        return prom.scrape(f"http://127.0.0.1:{self.port}/metrics")

    def total(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` that carry `labels`."""
        return prom.total(f"http://127.0.0.1:{self.port}/metrics", name, **labels)

    def peak_rss_bytes(self) -> int:
        """The process's peak resident memory (VmHWM in /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc status")

    def tail(self, lines: int = 40) -> str:
        """The end of the operator's log, for failure messages."""
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def make_namespace(cluster: Cluster, prefix: str) -> str:
    """A new namespace named after `prefix`."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    return name


def get_json(cluster: Cluster, *args: str) -> Any:
    """`kubectl get ... -o json`, decoded (None when the object does not exist)."""
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)
