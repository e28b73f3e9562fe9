"""Where a real node runs: a network namespace, a mount namespace and a cgroup of
its own, so that nothing it changes (routes, iptables and nftables rules, sysctls,
mounts, cgroups) outlives it or touches the machine's own.

A holder process keeps the namespaces; every node component starts inside them and
inside the node's cgroup (in every cgroup v1 hierarchy), and so do the containers the
kubelet starts, under the same cgroup. `destroy()` kills every process in the cgroup
and removes it: the namespaces then go, and with them the veth pair, the routes
through it and every mount made inside.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.devcluster.processes import ManagedProcess

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PREFIX = "pdserve-node-"
SYSTEM = "system"  # the node's components; the kubelet's pods go beside it
# Folders the node's tools write to by default (runc's and containerd's state under
# /run, CNI's IP allocations and caches under /var/lib/cni, pod logs under /var/log):
# inside the node's mount namespace they are empty and private, and vanish with it.
PRIVATE_FOLDERS = "".join(
    f"mount -t tmpfs -o mode=0755 pdserve-node {folder} && "
    for folder in ("/run", "/var/lib", "/var/log")
)


class SandboxError(RuntimeError):
    """This machine cannot host a node (no root, no cgroups, no namespaces)."""


@dataclass(frozen=True)
class Addresses:
    """The node's side of the veth pair, the machine's side, and the pods' networks."""

    host: str = "172.31.213.1"
    node: str = "172.31.213.2"
    prefix: int = 30
    pod_subnet: str = "10.244.0.0/24"


def unsupported_reason() -> str | None:
    """Why this machine cannot run a node, or None when it can."""
    if os.geteuid() != 0:
        return "a real node runs as root (kubelet, containerd, network namespaces)"
    if not (CGROUP_ROOT / "pids" / "cgroup.procs").exists():
        return "a real node needs cgroup v1 hierarchies under /sys/fs/cgroup (pids missing)"
    for tool in ("ip", "nsenter", "unshare"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"a real node needs `{tool}` (iproute2, util-linux)"
    return None


def _hierarchies() -> list[Path]:
    return sorted(p for p in CGROUP_ROOT.iterdir() if (p / "cgroup.procs").exists())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_cgroup(name: str, timeout: float = 20.0) -> None:
    """SIGKILL every process in cgroup `name` (all hierarchies, nested), until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = {
            int(line)
            for hierarchy in _hierarchies()
            if (hierarchy / name).is_dir()
            for procs in (hierarchy / name).rglob("cgroup.procs")
            for line in procs.read_text().split()
        }
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _remove_cgroup(name: str) -> None:
    for hierarchy in _hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for folder in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
        ):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def sweep_stale() -> None:
    """Remove the cgroups (and kill the processes) of nodes whose owner is gone."""
    for folder in (CGROUP_ROOT / "pids").glob(f"{CGROUP_PREFIX}*"):
        owner = folder.name.removeprefix(CGROUP_PREFIX)
        if owner.isdigit() and not _pid_alive(int(owner)):
            _kill_cgroup(folder.name)
            _remove_cgroup(folder.name)


class Sandbox:
    """The namespaces and cgroup of one node (one per machine at a time)."""

    def __init__(self, work_dir: Path, addresses: Addresses) -> None:
        self.cgroup = f"{CGROUP_PREFIX}{os.getpid()}"
        self.addresses = addresses
        self.host_link = f"pdsn{os.getpid() % 100000}"
        self._work_dir = work_dir
        self._holder: ManagedProcess | None = None

    # -- lifecycle -------------------------------------------------------------------

    def create(self) -> None:
        """Make the cgroup, start the holder of the namespaces, wire the veth pair."""
        reason = unsupported_reason()
        if reason:
            raise SandboxError(reason)
        sweep_stale()
        self._make_cgroup()
        self._holder = self.spawn(
            "sandbox", ["sh", "-c", PRIVATE_FOLDERS + "exec sleep infinity"], entered=False,
            prefix=["unshare", "--net", "--mount", "--propagation", "private", "--"],
        )  # fmt: skip
        self._wait_for_namespaces()
        self._wire_network()

    def destroy(self) -> None:
        """Kill everything in the node's cgroup and remove it (the namespaces go too)."""
        _kill_cgroup(self.cgroup)
        _remove_cgroup(self.cgroup)
        if self._holder is not None:
            self._holder.stop()
            self._holder = None
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["ip", "link", "del", self.host_link], capture_output=True, check=True)

    # -- running things inside -------------------------------------------------------

    def enter(self, args: Sequence[str]) -> list[str]:
        """The command line running `args` inside the node's namespaces."""
        holder = self._holder_pid()
        return ["nsenter", f"--net=/proc/{holder}/ns/net", f"--mount=/proc/{holder}/ns/mnt",
                "--", *args]  # fmt: skip

    def spawn(
        self,
        name: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        entered: bool = True,
        prefix: Sequence[str] = (),
    ) -> ManagedProcess:
        """Start `args` in the node's cgroup (and namespaces, when `entered`)."""
        command = [*prefix, *(self.enter(args) if entered else args)]
        joins = " ".join(
            shlex.quote(str(h / self.cgroup / SYSTEM / "cgroup.procs")) for h in _hierarchies()
        )
        script = f'for f in {joins}; do echo $$ > "$f"; done; exec "$@"'
        log = self._work_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        process = ManagedProcess(name, ["sh", "-c", script, "sh", *command], log, env)
        process.start()
        return process

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a short command inside the node's namespaces, its output captured."""
        return subprocess.run(self.enter(args), capture_output=True, text=True, check=check)

    # -- steps -----------------------------------------------------------------------

    def _holder_pid(self) -> int:
        if self._holder is None or self._holder.pid is None:
            raise RuntimeError("sandbox not created")
        # The holder is `sh` that exec'd unshare, which exec'd sleep: the same pid.
        return self._holder.pid

    def _make_cgroup(self) -> None:
        for hierarchy in _hierarchies():
            system = hierarchy / self.cgroup / SYSTEM
            system.mkdir(parents=True, exist_ok=True)
            if hierarchy.name == "cpuset":
                # A cpuset cgroup takes no process until it is given CPUs and memory nodes.
                for folder in (system.parent, system):
                    for key in ("cpuset.cpus", "cpuset.mems"):
                        (folder / key).write_text((hierarchy / key).read_text())

    def _wait_for_namespaces(self, timeout: float = 10.0) -> None:
        pid = self._holder_pid()
        deadline = time.monotonic() + timeout
        while os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            if time.monotonic() > deadline:
                raise SandboxError("the node's network namespace did not appear")
            time.sleep(0.05)

    def _wire_network(self) -> None:
        a = self.addresses
        pid = self._holder_pid()
        host = ["ip", "link", "add", self.host_link, "type", "veth", "peer", "name", "eth0",
                "netns", str(pid)]  # fmt: skip
        for command in (
            host,
            ["ip", "addr", "add", f"{a.host}/{a.prefix}", "dev", self.host_link],
            ["ip", "link", "set", self.host_link, "up"],
        ):
            subprocess.run(command, capture_output=True, text=True, check=True)
        inside: tuple[tuple[str, ...], ...] = (
            ("ip", "link", "set", "lo", "up"),
            ("ip", "addr", "add", f"{a.node}/{a.prefix}", "dev", "eth0"),
            ("ip", "link", "set", "eth0", "up"),
            ("ip", "route", "add", "default", "via", a.host),
            # Forwarding between pods, and bridged traffic through netfilter (Services,
            # NetworkPolicies), in the node's namespace only.
            ("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"),
            ("sh", "-c", "echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables"),
        )
        for step in inside:
            self.run(*step)

    def route_from_host(self, cidr: str) -> None:
        """Route `cidr` (pods, Services) from the machine to the node: the route goes
        with the veth pair."""
        subprocess.run(
            ["ip", "route", "replace", cidr, "via", self.addresses.node, "dev", self.host_link],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
