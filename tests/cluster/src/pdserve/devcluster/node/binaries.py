"""Where a real node's binaries are, building them first when they are missing
(scripts/build-node.sh: kubelet, kube-proxy, containerd, the CNI plugins, CoreDNS,
kube-network-policies, pause; runc, iptables and nft from Debian's packages)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pdserve.devcluster.binaries import BinariesError, find_build_script

BUILD_SCRIPT = Path("scripts") / "build-node.sh"
NAMES = (
    "kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "runc",
    "bridge", "host-local", "loopback", "portmap", "coredns", "kube-network-policies",
    "pause", "iptables", "nft",
)  # fmt: skip


@dataclass(frozen=True)
class NodeBinaries:
    """The folder holding every executable a node runs (also its PATH)."""

    bin_dir: Path

    def path(self, name: str) -> Path:
        """The executable called `name` (one of NAMES)."""
        if name not in NAMES:
            raise KeyError(name)
        return self.bin_dir / name

    def missing(self) -> list[str]:
        """Names of the executables that are not there."""
        return [n for n in NAMES if not os.access(self.path(n), os.X_OK)]


def ensure_node_binaries(*, build: bool = True) -> NodeBinaries:
    """The node's binaries, built into the version-keyed cache if missing (a cold build
    takes tens of minutes; the script returns at once once they are there)."""
    script = find_build_script(script_path=BUILD_SCRIPT)
    args = [str(script)] if build else [str(script), "--check"]
    result = subprocess.run(args, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise BinariesError(f"{script} failed with exit status {result.returncode}")
    found = NodeBinaries(Path(result.stdout.strip().splitlines()[-1]))
    if found.missing():
        raise BinariesError(f"{found.bin_dir} lacks {', '.join(found.missing())}")
    return found
