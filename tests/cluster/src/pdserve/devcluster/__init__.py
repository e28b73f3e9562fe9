"""A local Kubernetes control plane for tests and development.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (one simulated
GPU node), started by `DevCluster` or `python -m pdserve.devcluster`.
"""

from pdserve.devcluster.controlplane import DevCluster, KubectlError

__all__ = ["DevCluster", "KubectlError"]
