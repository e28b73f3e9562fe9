"""`python -m pdserve.devcluster.node`: the control plane and a real node, in the
foreground (what `make cluster-node` runs). Prints `export KUBECONFIG=...`, runs until
Ctrl-C or SIGTERM, then stops the node (every container with it) and the control plane,
leaving nothing behind on the machine."""

from __future__ import annotations

import signal
import sys

from pdserve.devcluster.__main__ import _interrupt
from pdserve.devcluster.node.cluster import NodeCluster
from pdserve.devcluster.node.sandbox import SandboxError


def main() -> int:
    """Start the cluster and its node, print how to use it, block until interrupted."""
    signal.signal(signal.SIGTERM, _interrupt)
    cluster = NodeCluster()
    try:
        cluster.start()
        print(f"# cluster and node up in {cluster.startup_seconds:.1f}s; logs: {cluster.work_dir}")
        print(f"# node {cluster.node_name} at {cluster.addresses.node} (pods and Services routed)")
        enforcer = cluster.network_policies
        if enforcer is not None and enforcer.unsupported:
            print(f"# {enforcer.unsupported}", file=sys.stderr)
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        print("# Ctrl-C stops the cluster", file=sys.stderr, flush=True)
        while True:
            signal.pause()
    except SandboxError as error:
        print(f"cannot run a node here: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("# stopping", file=sys.stderr)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
