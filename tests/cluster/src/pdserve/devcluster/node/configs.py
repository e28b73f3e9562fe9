"""The configuration files and command lines of a real node's components, as pure
functions of where things are (`NodePaths`) and the node's addresses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.devcluster.components import POD_CIDR, SERVICE_CIDR
from pdserve.devcluster.node.sandbox import Addresses

CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "localhost/pdserve-pause:1.0"
CONTAINERD_NAMESPACE = "k8s.io"


@dataclass(frozen=True)
class NodePaths:
    """Where one node's binaries, state and configuration are."""

    bin_dir: Path
    work_dir: Path
    # containerd's content and snapshots: kept between runs (under the user's cache),
    # so images are loaded once, not at each start.
    image_store: Path
    ca_cert: Path

    def file(self, name: str) -> Path:
        """A configuration file of the node."""
        path = self.work_dir / "node" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def state(self, component: str) -> Path:
        """A private state directory of `component`."""
        path = self.work_dir / "node" / "state" / component
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def containerd_socket(self) -> Path:
        """containerd's gRPC socket (the kubelet's CRI endpoint)."""
        return self.state("containerd") / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        """The CNI network configurations containerd reads."""
        path = self.work_dir / "node" / "cni"
        path.mkdir(parents=True, exist_ok=True)
        return path


def containerd_config(paths: NodePaths) -> str:
    """containerd 2.x (config version 3): CRI with runc under cgroupfs, the CNI plugins
    of the node, the locally built pause image, no registry."""
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = "{paths.image_store}"
state = "{paths.state("containerd")}/run"

[grpc]
  address = "{paths.containerd_socket}"

[{runtime}]
  enable_selinux = false
  # Without CAP_SYS_RESOURCE (some VMs) no process may lower its OOM score below its
  # parent's: the kubelet's -998 for pod sandboxes would fail every pod.
  restrict_oom_score_adj = true

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{runtime}.containerd.runtimes.runc.options]
  BinaryName = "{paths.bin_dir / "runc"}"
  SystemdCgroup = false

[{runtime}.cni]
  bin_dirs = ["{paths.bin_dir}"]
  conf_dir = "{paths.cni_conf_dir}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def cni_config(addresses: Addresses) -> str:
    """A bridge network: every pod on the node's bridge, routed and masqueraded out."""
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "pdserve-node",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": addresses.pod_subnet}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
                {"type": "loopback"},
            ],
        },
        indent=2,
    )


def kubelet_config(paths: NodePaths, addresses: Addresses, cgroup: str) -> str:
    """The kubelet's KubeletConfiguration (JSON is YAML): cgroup v1 allowed, cgroupfs,
    pods under the node's own cgroup, DNS from the node's CoreDNS, no eviction for a
    shared machine's disk use."""
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{cgroup}",
        "containerRuntimeEndpoint": f"unix://{paths.containerd_socket}",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(paths.ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "address": addresses.node,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "clusterDNS": [addresses.node],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(paths.file("resolv.conf")),
        "failSwapOn": False,
        "serializeImagePulls": False,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "podCIDR": addresses.pod_subnet,
        "maxPods": 110,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
    }
    return json.dumps(config, indent=2)


def kubelet_args(
    paths: NodePaths, node_name: str, kubeconfig: Path, addresses: Addresses
) -> list[str]:
    """The kubelet, registering `node_name` at the node's address."""
    return [
        str(paths.bin_dir / "kubelet"),
        f"--config={paths.file('kubelet.json')}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={paths.state('kubelet')}",
        f"--cert-dir={paths.state('kubelet') / 'pki'}",
        f"--hostname-override={node_name}",
        f"--node-ip={addresses.node}",
        "--v=1",
    ]


def kube_proxy_args(paths: NodePaths, node_name: str, kubeconfig: Path) -> list[str]:
    """kube-proxy in iptables mode (Debian's iptables on nf_tables), touching no
    machine-wide sysctl: conntrack sizes and timeouts are left as they are."""
    return [
        str(paths.bin_dir / "kube-proxy"),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        f"--cluster-cidr={POD_CIDR}",
        "--proxy-mode=iptables",
        "--conntrack-max-per-core=0",
        "--conntrack-min=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
        "--metrics-bind-address=127.0.0.1:10249",
        "--healthz-bind-address=127.0.0.1:10256",
        "--v=1",
    ]


def corefile(addresses: Addresses, kubeconfig: Path) -> str:
    """CoreDNS answering for the cluster's Services and Pods at the node's address."""
    return f""".:53 {{
    bind {addresses.node}
    errors
    health 127.0.0.1:8081
    ready 127.0.0.1:8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""


def network_policies_args(paths: NodePaths, node_name: str) -> list[str]:
    """kube-network-policies, enforcing NetworkPolicies for the node's pods."""
    return [
        str(paths.bin_dir / "kube-network-policies"),
        f"--hostname-override={node_name}",
        "--fail-open=false",
        "--metrics-bind-address=127.0.0.1:9080",
        "--v=1",
    ]


def service_cidr() -> str:
    """The Services' virtual addresses (the control plane's range)."""
    return SERVICE_CIDR
