"""DevCluster: a real Kubernetes control plane on loopback with a simulated GPU node.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler are the upstream
binaries; kwok plays the kubelet of one fake node (8 GPUs), so pods are scheduled,
turn Ready and are deleted as on a real cluster, without containers running.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from pdserve.devcluster import components
from pdserve.devcluster.apiclient import ApiReader, http_ok
from pdserve.devcluster.binaries import ensure_binaries
from pdserve.devcluster.certs import make_pki
from pdserve.devcluster.components import LOOPBACK, Layout, Ports
from pdserve.devcluster.kubeconfig import write_kubeconfig
from pdserve.devcluster.kwok_stages import write_stages
from pdserve.devcluster.nodes import gpu_node, node_schedulable
from pdserve.devcluster.processes import ManagedProcess, wait_until

# Client certificate file name -> user name. Each component has its own identity, so
# the API server's logs and audit say who did what.
CLIENTS = {
    "admin": "kubernetes-admin",
    "kube-controller-manager": "system:kube-controller-manager",
    "kube-scheduler": "system:kube-scheduler",
    "kwok": "kwok-controller",
    components.FRONT_PROXY: components.FRONT_PROXY_USER,
}
# Clients that get a kubeconfig (the front proxy only needs its certificate).
KUBECONFIG_CLIENTS = ("admin", "kube-controller-manager", "kube-scheduler", "kwok")

TEMP_PREFIX = "pdserve-devcluster-"
OWNER_FILE = "owner.pid"


def _pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class KubectlError(subprocess.CalledProcessError):
    """A kubectl command failed; the message includes what kubectl printed."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr or ''}{self.stdout or ''}".rstrip()


class DevCluster:
    """A local control plane, started by `start()` (or `with`) and removed by `stop()`.

    All state (keys, etcd data, logs, kubeconfig) lives in a temporary directory, or
    in `work_dir` when given (then kept after stop, for inspection). Child processes
    die with this process even when it is killed (Linux: PR_SET_PDEATHSIG, which
    follows the thread that called start(): call it from a long-lived thread).
    """

    def __init__(
        self,
        *,
        work_dir: Path | None = None,
        node_name: str = "kwok-gpu-0",
        gpus: int = 8,
        startup_timeout: float = 180.0,
        build: bool = True,
        api_address: str = LOOPBACK,
        extra_clients: dict[str, str] | None = None,
    ) -> None:
        """`api_address`: where the API server listens (a real node's network reaches
        it there); `extra_clients`: more kubeconfigs to write, file name -> user name."""
        self.node_name = node_name
        self.gpus = gpus
        self.startup_timeout = startup_timeout
        self._build = build
        self._given_dir = work_dir
        self._api_address = api_address
        self._clients = {**CLIENTS, **(extra_clients or {})}
        self._kubeconfig_clients = (*KUBECONFIG_CLIENTS, *(extra_clients or {}))
        self._layout: Layout | None = None
        self._processes: list[ManagedProcess] = []
        self._reader: ApiReader | None = None
        self.startup_seconds: float | None = None

    # -- public interface --------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (client certificate in group system:masters)."""
        return self._started().kubeconfig("admin")

    @property
    def server(self) -> str:
        """The API server URL, https://127.0.0.1:PORT (or the address it was given)."""
        layout = self._started()
        return f"https://{layout.api_address}:{layout.ports.apiserver}"

    @property
    def work_dir(self) -> Path:
        """The directory holding this cluster's state and logs (logs/<component>.log)."""
        return self._started().work_dir

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raise KubectlError on failure if `check`."""
        layout = self._started()
        command = [str(layout.binaries.path("kubectl")), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(command, input=input, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, command, result.stdout, result.stderr)
        return result

    def start(self) -> DevCluster:
        """Build binaries if needed, start every component, wait for a Ready node."""
        if self._layout is not None:
            raise RuntimeError("cluster already started")
        began = time.monotonic()
        binaries = ensure_binaries(build=self._build)
        work_dir = self._given_dir or self._new_temp_dir()
        work_dir.mkdir(parents=True, exist_ok=True)
        serving_ips = () if self._api_address == LOOPBACK else (self._api_address,)
        pki = make_pki(work_dir / "pki", self._clients, serving_ips)
        self._layout = Layout(binaries, pki, work_dir, Ports.allocate(), self._api_address)
        atexit.register(self.stop)
        try:
            self._start_components()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop every process (newest first) and remove the temporary state."""
        atexit.unregister(self.stop)
        for process in reversed(self._processes):
            process.stop()
        self._processes = []
        if self._layout is not None and self._given_dir is None:
            shutil.rmtree(self._layout.work_dir, ignore_errors=True)
        self._layout = None
        self._reader = None

    def __enter__(self) -> DevCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- start-up steps ----------------------------------------------------------

    def _started(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("cluster not started: call start() first")
        return self._layout

    @staticmethod
    def _new_temp_dir() -> Path:
        # A cluster whose owner was killed (SIGKILL) could not remove its directory:
        # sweep those first, recognised by an owner pid that no longer runs.
        root = Path(tempfile.gettempdir())
        for stale in root.glob(f"{TEMP_PREFIX}*/{OWNER_FILE}"):
            owner = stale.read_text().strip()
            if not (owner.isdigit() and int(owner) > 0 and _pid_alive(int(owner))):
                shutil.rmtree(stale.parent, ignore_errors=True)
        work_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
        (work_dir / OWNER_FILE).write_text(str(os.getpid()))
        return work_dir

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> ManagedProcess:
        process = ManagedProcess(name, args, self._started().log(name), env)
        process.start()
        self._processes.append(process)
        return process

    def _start_components(self) -> None:
        layout = self._started()
        for component in self._kubeconfig_clients:
            user = self._clients[component]
            write_kubeconfig(
                layout.kubeconfig(component),
                self.server,
                layout.pki.ca.cert,
                layout.pki.clients[component],
                user,
            )
        self._reader = ApiReader(self.server, layout.pki.ca.cert, layout.pki.clients["admin"])
        etcd = self._spawn("etcd", components.etcd_args(layout))
        health = components.etcd_health_url(layout)
        wait_until(lambda: http_ok(health), self.startup_timeout, "etcd /health", [etcd])
        apiserver = self._spawn("kube-apiserver", components.apiserver_args(layout))
        wait_until(
            self._reader.ready, self.startup_timeout, "kube-apiserver /readyz", [etcd, apiserver]
        )
        stages = write_stages(layout.work_dir / "kwok-stages.yaml")
        # kwok also reads ~/.kwok/kwok.yaml: a private HOME keeps a user's file out.
        kwok_env = {**os.environ, "HOME": str(layout.data("kwok"))}
        watched = [
            etcd,
            apiserver,
            self._spawn("kube-controller-manager", components.controller_manager_args(layout)),
            self._spawn("kube-scheduler", components.scheduler_args(layout)),
            self._spawn("kwok", components.kwok_args(layout, stages), kwok_env),
        ]
        self.kubectl("create", "-f", "-", input=json.dumps(gpu_node(self.node_name, self.gpus)))
        wait_until(
            self._node_schedulable,
            self.startup_timeout,
            f"node {self.node_name} Ready and untainted",
            watched,
        )
        # Pods are refused until the controller-manager has made the default ServiceAccount.
        wait_until(
            self._default_service_account,
            self.startup_timeout,
            "serviceaccount default/default",
            watched,
        )

    def _node_schedulable(self) -> bool:
        assert self._reader is not None
        return node_schedulable(self._reader.get_json(f"/api/v1/nodes/{self.node_name}"))

    def _default_service_account(self) -> bool:
        assert self._reader is not None
        path = "/api/v1/namespaces/default/serviceaccounts/default"
        return self._reader.get_json(path) is not None
