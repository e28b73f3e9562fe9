"""A local Kubernetes control plane for tests and development.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (one simulated
GPU node), started by `DevCluster` or `python -m pdserve.operator.devcluster`.
"""

from pdserve.operator.devcluster.controlplane import DevCluster, KubectlError

__all__ = ["DevCluster", "KubectlError"]
