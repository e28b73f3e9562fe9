"""Running `pdserve operator` as a real process against the dev cluster, for tests.

The operator runs under the ServiceAccount and RBAC of the Helm chart (a token
kubeconfig), so the tests also prove they grant enough. The tests make a namespace
each, so the chart's cluster-wide mode is used (rbac.namespaced false: a ClusterRole
with the same rules as the default's Role per watched namespace);
tests/e2e/test_chart.py installs the default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import yaml

from pdserve.base.process import pdserve_command
from render_deploy import NAMESPACE, RELEASE, template
from support import apiserver, prom
from support.waiting import wait_until as wait_until  # tests import it from here

ROOT = Path(__file__).resolve().parents[2]
IDENTITY_TEMPLATES = ("templates/serviceaccount.yaml", "templates/rbac.yaml")
CRDS = ROOT / "charts" / "pdserve" / "crds"
OPERATOR_NAMESPACE = NAMESPACE
OPERATOR_ACCOUNT = f"{RELEASE}-operator"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
POOL_LABEL = "pdserve.dev/pool"


class Cluster(Protocol):
    """The part of the dev cluster these helpers use."""

    @property
    def kubeconfig(self) -> Path: ...

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]: ...


def wait_established(cluster: Cluster, name: str, timeout_s: float = 60.0) -> None:
    """Wait until CustomResourceDefinition `name` is Established. (`kubectl wait` gives
    up at once while a new CRD has no conditions yet, so its status is polled.)"""

    def established() -> bool:
        crd = get_json(cluster, "crd", name)
        conditions = ((crd or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_until(established, timeout_s, f"CRD {name} to be established")


def install_crd(cluster: Cluster) -> None:
    """Apply the chart's CRD and wait until the API server serves ServingPools."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    wait_established(cluster, "servingpools.pdserve.dev")
    # Established comes before the API server's cache of the new resource is filled;
    # until then lists answer 429 ("storage is (re)initializing").
    wait_until(
        lambda: cluster.kubectl("get", "servingpools", "-A", check=False).returncode == 0,
        60,
        "the API server to list ServingPools",
    )


def operator_identity() -> str:
    """The chart's ServiceAccount and cluster-wide RBAC for the operator, as YAML."""
    shown = [arg for name in IDENTITY_TEMPLATES for arg in ("--show-only", name)]
    return template({"rbac": {"namespaced": False}}, extra=shown)


def operator_kubeconfig(cluster: Cluster, path: Path) -> Path:
    """A kubeconfig for the operator's ServiceAccount (the chart's, see the module)."""
    if cluster.kubectl("get", "namespace", OPERATOR_NAMESPACE, check=False).returncode:
        cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    cluster.kubectl("apply", "-f", "-", input=operator_identity())
    return account_kubeconfig(cluster, OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, path)


def account_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as ServiceAccount namespace/account (a token)."""
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

    def __init__(
        self,
        kubeconfig: Path,
        log: Path,
        namespaces: Sequence[str] = (),
        *,
        pdserve: Sequence[str] = (),
        args: Sequence[str] = (),
    ) -> None:
        """`pdserve` is the command that runs pdserve (default: this interpreter's);
        `args` are more options of `pdserve operator`."""
        self.kubeconfig = kubeconfig
        self.log = log
        self.namespaces = tuple(namespaces)
        self.pdserve = tuple(pdserve) or tuple(pdserve_command())
        self.args = tuple(args)
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
        command = [*self.pdserve, "operator", *scope, "--kubeconfig", str(self.kubeconfig)]
        command += [*self.args, "--metrics-host", "127.0.0.1", "--metrics-port", "0"]
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


@contextmanager
def running(process: OperatorProcess) -> Iterator[OperatorProcess]:
    """The operator started; stopped afterwards, with the end of its log printed."""
    try:
        yield process.start()
    finally:
        process.stop()
        print(f"--- operator log ---\n{process.tail(80)}")


def get_json(cluster: Cluster, *args: str) -> Any:
    """`kubectl get ... -o json`, decoded (None when the object does not exist). The
    forms the tests poll with are read in-process (support.apiserver), the rest by
    kubectl."""
    get = apiserver.parse(args)
    client = apiserver.client(cluster.kubeconfig) if get is not None else None
    if get is not None and client is not None:
        try:
            return client.read(get)
        except apiserver.NotServed:
            pass  # kubectl says why
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)
