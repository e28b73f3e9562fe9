"""Command lines of the control-plane components, as pure functions of the layout."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from pdserve.devcluster.binaries import Binaries
from pdserve.devcluster.certs import ClusterPKI

LOOPBACK = "127.0.0.1"
# Room for a ClusterIP per pool and more at the scale benchmarks' thousands of pools.
SERVICE_CIDR = "10.0.0.0/16"
POD_CIDR = "10.244.0.0/16"
# The address kwok reports for its nodes. Nothing listens there: no kubelet runs.
NODE_IP = "10.88.0.1"
NODE_ANNOTATION = "kwok.x-k8s.io/node"
# Client certificate (file name, user) the API server presents to aggregated APIs.
FRONT_PROXY = "front-proxy-client"
FRONT_PROXY_USER = "front-proxy-client"
NODE_ANNOTATION_VALUE = "fake"


@dataclass(frozen=True)
class Ports:
    """Loopback ports of one cluster, all distinct."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int

    @classmethod
    def allocate(cls) -> Ports:
        """Free ports chosen by the kernel, held open together so none repeats."""
        sockets = [socket.socket() for _ in range(6)]
        try:
            for sock in sockets:
                sock.bind((LOOPBACK, 0))
            return cls(*(sock.getsockname()[1] for sock in sockets))
        finally:
            for sock in sockets:
                sock.close()


@dataclass(frozen=True)
class Layout:
    """Where one cluster's binaries, keys, kubeconfigs and data are."""

    binaries: Binaries
    pki: ClusterPKI
    work_dir: Path
    ports: Ports
    # Where the API server listens: loopback, or an address a node's network reaches.
    api_address: str = LOOPBACK

    def kubeconfig(self, component: str) -> Path:
        """The kubeconfig of `component` ("admin" is the user's)."""
        return self.work_dir / "kubeconfig" / f"{component}.yaml"

    def data(self, component: str) -> Path:
        """A private directory of `component`."""
        path = self.work_dir / "data" / component
        # Private (etcd warns otherwise): it holds keys and cluster data.
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def log(self, component: str) -> Path:
        """The log file of `component`."""
        path = self.work_dir / "logs" / f"{component}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


def etcd_health_url(layout: Layout) -> str:
    """etcd's health endpoint, plain HTTP on loopback."""
    return f"http://{LOOPBACK}:{layout.ports.etcd_client}/health"


def etcd_args(layout: Layout) -> list[str]:
    """A single-member etcd on loopback; no fsync: the data is thrown away anyway."""
    client = f"http://{LOOPBACK}:{layout.ports.etcd_client}"
    peer = f"http://{LOOPBACK}:{layout.ports.etcd_peer}"
    return [
        str(layout.binaries.path("etcd")),
        "--name=devcluster",
        f"--data-dir={layout.data('etcd')}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def apiserver_args(layout: Layout) -> list[str]:
    """kube-apiserver with client-certificate authentication and RBAC."""
    pki = layout.pki
    return [
        str(layout.binaries.path("kube-apiserver")),
        f"--etcd-servers=http://{LOOPBACK}:{layout.ports.etcd_client}",
        f"--bind-address={layout.api_address}",
        f"--advertise-address={layout.api_address}",
        f"--secure-port={layout.ports.apiserver}",
        f"--cert-dir={layout.data('kube-apiserver')}",
        f"--tls-cert-file={pki.serving.cert}",
        f"--tls-private-key-file={pki.serving.key}",
        f"--client-ca-file={pki.ca.cert}",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        # The front-proxy settings let aggregated API servers (and the delegated
        # authentication of the controller-manager and scheduler) trust the API server.
        f"--requestheader-client-ca-file={pki.ca.cert}",
        f"--requestheader-allowed-names={FRONT_PROXY_USER}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.clients[FRONT_PROXY].cert}",
        f"--proxy-client-key-file={pki.clients[FRONT_PROXY].key}",
        *_endpoint_reconciler(layout),
        # Logs, exec and port-forward reach a real node's kubelet as the admin.
        f"--kubelet-client-certificate={pki.clients['admin'].cert}",
        f"--kubelet-client-key={pki.clients['admin'].key}",
        "--kubelet-preferred-address-types=InternalIP",
        "--profiling=false",
    ]


def _endpoint_reconciler(layout: Layout) -> list[str]:
    # Endpoints of the `kubernetes` Service would name a loopback address, which
    # EndpointSlice validation rejects: kept only where pods can reach the API server.
    return ["--endpoint-reconciler-type=none"] if layout.api_address == LOOPBACK else []


def _serving_flags(layout: Layout, component: str, port: int) -> list[str]:
    kubeconfig = layout.kubeconfig(component)
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--cert-dir={layout.data(component)}",
        # One instance per cluster: leader election would only delay the start.
        "--leader-elect=false",
        "--profiling=false",
    ]


def controller_manager_args(layout: Layout) -> list[str]:
    """kube-controller-manager: Deployments, ReplicaSets, garbage collection, nodes."""
    pki = layout.pki
    return [
        str(layout.binaries.path("kube-controller-manager")),
        *_serving_flags(layout, "kube-controller-manager", layout.ports.controller_manager),
        f"--root-ca-file={pki.ca.cert}",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--cluster-signing-cert-file={pki.ca.cert}",
        f"--cluster-signing-key-file={pki.ca.key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
        # Its client's default rate (20 requests/s) paces every Deployment's ReplicaSet,
        # pods and status writes: with hundreds of pools that limit, not the operator,
        # would set how fast pools become Ready. Clusters of that size raise it too.
        "--kube-api-qps=300",
        "--kube-api-burst=600",
    ]


def scheduler_args(layout: Layout) -> list[str]:
    """kube-scheduler with its default profile."""
    return [
        str(layout.binaries.path("kube-scheduler")),
        *_serving_flags(layout, "kube-scheduler", layout.ports.scheduler),
    ]


def kwok_args(layout: Layout, stages: Path) -> list[str]:
    """kwok, managing only nodes annotated kwok.x-k8s.io/node=fake."""
    return [
        str(layout.binaries.path("kwok")),
        f"--kubeconfig={layout.kubeconfig('kwok')}",
        f"--config={stages}",
        f"--manage-nodes-with-annotation-selector={NODE_ANNOTATION}={NODE_ANNOTATION_VALUE}",
        f"--node-ip={NODE_IP}",
        f"--cidr={POD_CIDR}",
        "--node-lease-duration-seconds=40",
        f"--server-address={LOOPBACK}:{layout.ports.kwok}",
    ]
