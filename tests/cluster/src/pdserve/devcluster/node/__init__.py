"""A real node for the dev cluster: kubelet, containerd, CNI, kube-proxy, CoreDNS and
kube-network-policies in a sandbox of their own (see `cluster.NodeCluster`)."""

from pdserve.devcluster.node.cluster import NodeCluster
from pdserve.devcluster.node.sandbox import SandboxError, unsupported_reason

__all__ = ["NodeCluster", "SandboxError", "unsupported_reason"]
