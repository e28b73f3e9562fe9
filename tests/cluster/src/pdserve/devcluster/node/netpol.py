"""The node's NetworkPolicy implementation: sigs.k8s.io/kube-network-policies, run as
a process in the node's namespaces with a ServiceAccount of its own (it only reads
in-cluster credentials), and a probe of whether this kernel can run it at all."""

from __future__ import annotations

import json
import subprocess
from typing import Any, Protocol

from pdserve.devcluster.controlplane import DevCluster
from pdserve.devcluster.node import configs
from pdserve.devcluster.processes import ManagedProcess

ACCOUNT = "kube-network-policies"
NAMESPACE = "kube-system"
TOKEN_DIR = "/run/secrets/kubernetes.io/serviceaccount"
# What it reads (its own install manifest's ClusterRole, without the admin policies).
RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods", "namespaces", "nodes"], "verbs": ["list", "watch"]},
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["list", "watch"],
    },
]
# kube-network-policies sends the first packet of each connection of a pod under a
# policy to user space: built here with the xtables NFQUEUE target (nft_compat), so
# that is what the kernel must offer (tried in the node's namespace, then removed).
PROBE = (
    "iptables -w -A FORWARD -j NFQUEUE --queue-num 65000 --queue-bypass "
    "-m comment --comment pdserve-probe; status=$?; "
    "iptables -w -D FORWARD -j NFQUEUE --queue-num 65000 --queue-bypass "
    "-m comment --comment pdserve-probe 2>/dev/null; exit $status"
)


def _access_objects() -> list[dict[str, Any]]:
    meta = {"name": ACCOUNT}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {**meta, "namespace": NAMESPACE},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": ACCOUNT,
            },
            "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}],
        },
    ]


class NodeHost(Protocol):
    """What the enforcer needs of the node it runs on (the node's cluster, above it)."""

    node_name: str

    @property
    def control_plane(self) -> DevCluster: ...

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]: ...

    def run_on_node(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]: ...

    def spawn_on_node(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> ManagedProcess: ...


class NetworkPolicyEnforcer:
    """kube-network-policies for one node."""

    def __init__(self, cluster: NodeHost, paths: configs.NodePaths) -> None:
        self._cluster = cluster
        self._paths = paths
        self.unsupported: str | None = None

    def start(self) -> ManagedProcess:
        """Give it its credentials and start it; `unsupported` says why it cannot enforce."""
        cluster, paths = self._cluster, self._paths
        self.unsupported = self._probe()
        items = {"apiVersion": "v1", "kind": "List", "items": _access_objects()}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(items))
        token = cluster.kubectl(
            "create", "token", ACCOUNT, "-n", NAMESPACE, "--duration=48h"
        ).stdout.strip()
        credentials = paths.state(ACCOUNT) / "serviceaccount"
        credentials.mkdir(parents=True, exist_ok=True)
        (credentials / "token").write_text(token)
        (credentials / "ca.crt").write_text(paths.ca_cert.read_text())
        (credentials / "namespace").write_text(NAMESPACE)
        cluster.run_on_node(
            "sh",
            "-c",
            f"mkdir -p {TOKEN_DIR.rsplit('/', 1)[0]} && ln -sfn {credentials} {TOKEN_DIR}",
        )
        server = cluster.control_plane.server.removeprefix("https://")
        host, port = server.rsplit(":", 1)
        env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
        return cluster.spawn_on_node(
            ACCOUNT, configs.network_policies_args(paths, cluster.node_name), env
        )

    def _probe(self) -> str | None:
        path = f"PATH={self._paths.bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"
        result = self._cluster.run_on_node("env", path, "sh", "-c", PROBE, check=False)
        if result.returncode == 0:
            return None
        return (
            "NetworkPolicies are not enforced on this node: kube-network-policies queues "
            "packets to user space with the NFQUEUE target, which this kernel lacks "
            f"(CONFIG_NETFILTER_XT_TARGET_NFQUEUE, nft_compat): {result.stderr.strip()[-300:]}"
        )
