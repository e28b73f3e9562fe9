# The local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok with one simulated 8-GPU node), built from Go modules.
#   make cluster-bin   build the binaries once (cached by version under ~/.cache/pdserve)
#   make cluster       run the cluster in the foreground; prints `export KUBECONFIG=...`

.PHONY: cluster-bin cluster

cluster-bin:
	@scripts/build-cluster.sh

cluster: venv cluster-bin
	$(PY) -m pdserve.devcluster
