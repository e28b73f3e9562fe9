"""Where a real node's binaries are, building them first when they are missing
(scripts/build-node.sh: kubelet, kube-proxy, containerd, the CNI plugins, CoreDNS,
kube-network-policies, pause; runc, iptables and nft from Debian's packages)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pdserve.devcluster.binaries import Binaries, built_by, find_build_script

BUILD_SCRIPT = Path("scripts") / "build-node.sh"
NAMES = (
    "kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "runc",
    "bridge", "host-local", "loopback", "portmap", "coredns", "kube-network-policies",
    "pause", "iptables", "nft",
)  # fmt: skip


@dataclass(frozen=True)
class NodeBinaries(Binaries):
    """The folder holding every executable a node runs (also its PATH)."""

    names: ClassVar[tuple[str, ...]] = NAMES


def ensure_node_binaries(*, build: bool = True) -> NodeBinaries:
    """The node's binaries, built into the version-keyed cache if missing (a cold build
    takes tens of minutes; the script returns at once once they are there)."""
    return built_by(find_build_script(script_path=BUILD_SCRIPT), NodeBinaries, build=build)
