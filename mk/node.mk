# A real node joined to the local control plane: kubelet, containerd (runc, CNI),
# kube-proxy, CoreDNS and kube-network-policies, built from Go modules (and Debian's
# packages) once, cached by version under ~/.cache/pdserve/node. Runs as root, in a
# network namespace, mount namespace and cgroup of its own; nothing is left behind.
#   make cluster-node-bin   build the node's binaries once
#   make cluster-node       run the control plane and the node in the foreground
#   make e2e-node           the rendered pods on the node (helm install, pools, drains)
#   make bench-node         the node's measurements (start-up, hand-off, scale)

.PHONY: cluster-node-bin cluster-node e2e-node bench-node

cluster-node-bin:
	@scripts/build-node.sh

cluster-node: venv cluster-bin cluster-node-bin
	$(PY) -m pdserve.devcluster.node

# Not part of `make test`: warm it takes about 4 minutes on two loaded cores (three
# pods starting torch, load for a deleted pod and a drain), which `make test`'s
# 10-minute budget does not hold beside unit and e2e; cold it builds the node (over an
# hour here) and loads the 6.5 GB worker image into containerd (about 13 minutes).
e2e-node: venv cluster-bin cluster-node-bin helm-bin images
	$(BIN)/pytest tests/node -m "node and not slow" $(PYTEST_ARGS)

bench-node: venv cluster-bin cluster-node-bin helm-bin images
	$(BIN)/pytest tests/node -m "node and slow" -s $(PYTEST_ARGS)
