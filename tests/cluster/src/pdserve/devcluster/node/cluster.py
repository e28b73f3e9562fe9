"""NodeCluster: the dev cluster's control plane with a real node joined to it.

The node runs containerd (runc, the CNI bridge), the kubelet, kube-proxy, CoreDNS and
kube-network-policies inside a sandbox of its own (network and mount namespaces, a
cgroup): pods start in real containers from images loaded without a registry, get
addresses on the node's bridge, reach Services through kube-proxy and names through
CoreDNS. The machine reaches pods and Services through a route to the node's address;
everything the node changed goes away with `stop()`.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from pdserve.devcluster.apiclient import ApiReader
from pdserve.devcluster.certs import KeyPair
from pdserve.devcluster.components import SERVICE_CIDR
from pdserve.devcluster.controlplane import DevCluster
from pdserve.devcluster.node import configs
from pdserve.devcluster.node.binaries import NodeBinaries, ensure_node_binaries
from pdserve.devcluster.node.images import ImageStore, pause_archive
from pdserve.devcluster.node.netpol import NetworkPolicyEnforcer
from pdserve.devcluster.node.sandbox import Addresses, Sandbox, SandboxError
from pdserve.devcluster.nodes import node_schedulable
from pdserve.devcluster.processes import ManagedProcess, wait_until

NODE_NAME = "node-0"
# The node's clients of the API server: file name -> user (certificate CN).
NODE_CLIENTS = {
    "kubelet": f"system:node:{NODE_NAME}",
    "kube-proxy": "system:kube-proxy",
    "coredns": "system:coredns",
}


def image_store_dir() -> Path:
    """containerd's content and snapshots, kept between runs under the user's cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pdserve" / "node" / "containerd"


class NodeCluster:
    """A DevCluster whose API server the node's network reaches, plus one real node.

    `start()` (or `with`) raises SandboxError where the machine cannot run a node (no
    root, no cgroups): callers skip with its message.
    """

    def __init__(self, *, startup_timeout: float = 300.0, build: bool = True) -> None:
        self.addresses = Addresses()
        self.node_name = NODE_NAME
        self.startup_timeout = startup_timeout
        self._build = build
        self._work_dir: Path | None = None
        self._sandbox: Sandbox | None = None
        self._control: DevCluster | None = None
        self._binaries: NodeBinaries | None = None
        self._paths: configs.NodePaths | None = None
        self._processes: list[ManagedProcess] = []
        self._lock: int | None = None
        self.network_policies: NetworkPolicyEnforcer | None = None
        self.startup_seconds: float | None = None

    # -- public interface --------------------------------------------------------

    @property
    def control_plane(self) -> DevCluster:
        """The control plane (kubeconfig, kubectl, the kwok node for scale tests)."""
        if self._control is None:
            raise RuntimeError("cluster not started: call start() first")
        return self._control

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig."""
        return self.control_plane.kubeconfig

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """kubectl against the cluster (see DevCluster.kubectl)."""
        return self.control_plane.kubectl(*args, check=check, input=input)

    @property
    def work_dir(self) -> Path:
        """State and logs of the node (logs/<component>.log) and the control plane."""
        if self._work_dir is None:
            raise RuntimeError("cluster not started: call start() first")
        return self._work_dir

    @property
    def sandbox(self) -> Sandbox:
        """The node's namespaces and cgroup (to run a command where the node is)."""
        if self._sandbox is None:
            raise RuntimeError("cluster not started: call start() first")
        return self._sandbox

    def images(self) -> ImageStore:
        """The node's containerd image store."""
        return ImageStore(self._ctr(), self._paths_or_fail().image_store.parent / "imported")

    def start(self) -> NodeCluster:
        """Build what is missing, start the control plane and the node, wait for it Ready."""
        began = time.monotonic()
        self._binaries = ensure_node_binaries(build=self._build)
        self._take_machine()
        self._work_dir = Path(tempfile.mkdtemp(prefix="pdserve-node-"))
        atexit.register(self.stop)
        try:
            self._sandbox = Sandbox(self._work_dir, self.addresses)
            self._sandbox.create()
            self._control = DevCluster(
                work_dir=self._work_dir / "control-plane",
                api_address=self.addresses.host,
                extra_clients=NODE_CLIENTS,
                startup_timeout=self.startup_timeout,
                build=self._build,
            ).start()
            self._start_node()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop the node (every container with it), the control plane, remove the state."""
        atexit.unregister(self.stop)
        for process in reversed(self._processes):
            process.stop()
        self._processes = []
        if self._sandbox is not None:
            self._sandbox.destroy()
            self._sandbox = None
        if self._control is not None:
            self._control.stop()
            self._control = None
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None
        if self._lock is not None:
            os.close(self._lock)  # releases the machine
            self._lock = None

    def __enter__(self) -> NodeCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- start-up steps ----------------------------------------------------------

    def _take_machine(self) -> None:
        """One node per machine: its addresses, routes and image store are fixed."""
        store = image_store_dir()
        store.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(store / "node.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise SandboxError("another dev cluster node runs on this machine") from None
        self._lock = descriptor

    def _paths_or_fail(self) -> configs.NodePaths:
        if self._paths is None:
            raise RuntimeError("node not started")
        return self._paths

    def _ctr(self) -> list[str]:
        paths = self._paths_or_fail()
        return [str(paths.bin_dir / "ctr"), "--address", str(paths.containerd_socket),
                "--namespace", configs.CONTAINERD_NAMESPACE]  # fmt: skip

    def spawn_on_node(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> ManagedProcess:
        """Start a node component (the node's tools first on its PATH), stopped with it."""
        paths = self._paths_or_fail()
        base = {
            "PATH": f"{paths.bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(paths.state(name)),
        }
        process = self.sandbox.spawn(name, args, {**base, **(env or {})})
        self._processes.append(process)
        return process

    def _start_node(self) -> None:
        control = self.control_plane
        assert self._binaries is not None
        store = image_store_dir()
        store.mkdir(parents=True, exist_ok=True)
        self._paths = paths = configs.NodePaths(
            self._binaries.bin_dir,
            self.work_dir,
            store / "root",
            control.work_dir / "pki" / "ca.crt",
        )
        kubeconfigs = control.work_dir / "kubeconfig"
        paths.file("containerd.toml").write_text(configs.containerd_config(paths))
        (paths.cni_conf_dir / "10-pdserve-node.conflist").write_text(
            configs.cni_config(self.addresses)
        )
        paths.file("resolv.conf").write_text("")
        paths.file("kubelet.json").write_text(
            configs.kubelet_config(paths, self.addresses, self.sandbox.cgroup)
        )
        paths.file("Corefile").write_text(
            configs.corefile(self.addresses, kubeconfigs / "coredns.yaml")
        )
        containerd = self.spawn_on_node(
            "containerd",
            [str(paths.bin_dir / "containerd"), f"--config={paths.file('containerd.toml')}"],
        )
        wait_until(self._containerd_ready, self.startup_timeout, "containerd", [containerd])
        self._load_pause_image()
        watched = [
            containerd,
            self.spawn_on_node(
                "kubelet",
                configs.kubelet_args(
                    paths, self.node_name, kubeconfigs / "kubelet.yaml", self.addresses
                ),
            ),
            self.spawn_on_node(
                "kube-proxy",
                configs.kube_proxy_args(paths, self.node_name, kubeconfigs / "kube-proxy.yaml"),
            ),
            self.spawn_on_node(
                "coredns", [str(paths.bin_dir / "coredns"), "-conf", str(paths.file("Corefile"))]
            ),
        ]
        for cidr in (self.addresses.pod_subnet, SERVICE_CIDR):
            self.sandbox.route_from_host(cidr)
        wait_until(self._node_ready, self.startup_timeout, f"node {self.node_name} Ready", watched)
        self.network_policies = NetworkPolicyEnforcer(self, paths)
        self.network_policies.start()

    def _containerd_ready(self) -> bool:
        result = subprocess.run([*self._ctr(), "version"], capture_output=True, check=False)
        return result.returncode == 0

    def _load_pause_image(self) -> None:
        store = self.images()
        if configs.PAUSE_IMAGE in store.names():
            return
        paths = self._paths_or_fail()
        archive = pause_archive(
            paths.bin_dir / "pause", configs.PAUSE_IMAGE, paths.file("pause.tar")
        )
        store.import_archive(archive)

    def _node_ready(self) -> bool:
        control = self.control_plane
        pki = control.work_dir / "pki"
        admin = KeyPair(pki / "admin.crt", pki / "admin.key")
        reader = ApiReader(control.server, pki / "ca.crt", admin)
        return node_schedulable(reader.get_json(f"/api/v1/nodes/{self.node_name}"))

    def run_on_node(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command where the node is (its network: pod and Service addresses)."""
        return self.sandbox.run(*args, check=check)

    def pods_json(self, namespace: str) -> list[dict[str, object]]:
        """The pods of a namespace, as the API returns them."""
        out = self.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout
        items: list[dict[str, object]] = json.loads(out)["items"]
        return items
