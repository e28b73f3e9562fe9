"""The real node's parts that need no node: its configuration files, the pause image
it makes without a registry, and its sandbox leaving the machine as it found it."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

from pdserve.devcluster.node import configs
from pdserve.devcluster.node.images import pause_archive
from pdserve.devcluster.node.sandbox import Addresses, Sandbox, unsupported_reason


def paths(tmp_path: Path) -> configs.NodePaths:
    return configs.NodePaths(
        tmp_path / "bin", tmp_path / "work", tmp_path / "store", tmp_path / "ca.crt"
    )


def test_containerd_runs_runc_under_cgroupfs_with_the_nodes_cni_and_pause_image(
    tmp_path: Path,
) -> None:
    node = paths(tmp_path)
    config = tomllib.loads(configs.containerd_config(node))
    runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
    options = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert options == {"BinaryName": str(node.bin_dir / "runc"), "SystemdCgroup": False}
    assert runtime["cni"]["bin_dirs"] == [str(node.bin_dir)]
    images = config["plugins"]["io.containerd.cri.v1.images"]
    assert images["pinned_images"]["sandbox"] == configs.PAUSE_IMAGE
    assert config["root"] == str(node.image_store)


def test_the_kubelet_allows_cgroup_v1_and_keeps_its_pods_in_the_nodes_cgroup(
    tmp_path: Path,
) -> None:
    config = json.loads(configs.kubelet_config(paths(tmp_path), Addresses(), "pdserve-node-7"))
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["cgroupRoot"] == "/pdserve-node-7"
    assert config["clusterDNS"] == [Addresses().node]
    assert config["authentication"]["anonymous"]["enabled"] is False


def test_kube_proxy_leaves_the_machines_conntrack_settings_alone(tmp_path: Path) -> None:
    args = configs.kube_proxy_args(paths(tmp_path), "node-0", tmp_path / "kubeconfig")
    for flag in ("--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0"):
        assert flag in args


def test_the_pause_image_holds_the_binary_its_config_names(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF pretend")
    with tarfile.open(pause_archive(binary, "localhost/p:1", tmp_path / "p.tar")) as archive:
        (manifest,) = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
        config = json.load(archive.extractfile(manifest["Config"]))  # type: ignore[arg-type]
        layer = archive.extractfile(manifest["Layers"][0]).read()  # type: ignore[union-attr]
    assert manifest["RepoTags"] == ["localhost/p:1"]
    assert config["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(layer).hexdigest()}"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as files:
        member = files.getmember("pause")
        assert member.mode == 0o755 and files.extractfile(member).read() == binary.read_bytes()  # type: ignore[union-attr]


# Where the sandbox mounts (its folder, and what it makes private to the node): other
# tests running beside this one (image builds) mount elsewhere on the machine.
SANDBOX_MOUNT_ROOTS = ("/mnt", "/run", "/var/lib", "/var/log", "/sys/fs/cgroup")


def mount_points(folder: Path) -> set[str]:
    """The machine's mount points the sandbox could have left behind."""
    roots = (str(folder), *SANDBOX_MOUNT_ROOTS)
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return {p for p in (line.split()[4] for line in lines) if p.startswith(roots)}


def test_the_sandbox_changes_nothing_on_the_machine_once_destroyed(tmp_path: Path) -> None:
    reason = unsupported_reason()
    if reason:
        pytest.skip(reason)
    links_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    mounts_before = mount_points(tmp_path)
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text()
    sandbox = Sandbox(tmp_path, Addresses())
    sandbox.create()
    try:
        inside = sandbox.run("ip", "-o", "addr").stdout
        assert Addresses().node in inside
        assert sandbox.run("cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "1"
        sandbox.run("sh", "-c", "mount -t tmpfs probe /mnt")
        assert " /mnt " not in Path("/proc/self/mountinfo").read_text()
    finally:
        sandbox.destroy()
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count(
        "\n"
    ) == links_before.count("\n")
    assert mount_points(tmp_path) == mounts_before
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text() == forward
    assert not any(p.startswith(sandbox.cgroup) for p in os.listdir("/sys/fs/cgroup/pids"))
