"""`python -m pdserve.devcluster`: run the dev cluster in the foreground.

Prints the `export KUBECONFIG=...` line for other shells and runs until Ctrl-C or
SIGTERM, then stops every component and removes the state (what `make cluster` runs).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from pdserve.devcluster.controlplane import DevCluster


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.devcluster",
        description="Run a local Kubernetes control plane with a simulated GPU node.",
    )
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the fake node (default 8)")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep state and logs here (default: a temporary directory, removed at exit)",
    )
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (e.g. from make or a supervisor) stops the cluster like Ctrl-C does.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Start the cluster, print how to use it, block until interrupted."""
    args = _parse(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    cluster = DevCluster(gpus=args.gpus, work_dir=args.work_dir)
    try:
        cluster.start()
        print(f"# cluster up in {cluster.startup_seconds:.1f}s; state and logs: {cluster.work_dir}")
        print(f"# node {cluster.node_name}: {cluster.gpus} x nvidia.com/gpu (simulated by kwok)")
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        print("# Ctrl-C stops the cluster", file=sys.stderr, flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("# stopping", file=sys.stderr)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
