#!/usr/bin/env bash
# Prints a directory of wrappers for Debian's buildah, podman and mmdebstrap that run
# from packages unpacked into ~/.cache/pdserve/container-tools-<key>/ (apt-get
# download and dpkg -x: nothing is installed on the machine). The unpacked binaries
# find the unpacked libraries through their RUNPATH (set with patchelf: buildah and
# podman run themselves again with a cleaned environment, so LD_LIBRARY_PATH would
# not reach them); the wrappers point the tools at their own configuration, at the
# unpacked runc and conmon, and at image storage under ~/.cache/pdserve/containers/.
#
# Root is needed to run them (storage and containers of root; no user namespaces).
# PDSERVE_STORAGE_DRIVER=vfs where overlayfs cannot be mounted (the default is overlay).
#
# Usage: scripts/ensure-container-tools.sh
#   "$(scripts/ensure-container-tools.sh)/buildah" images
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/debs.sh
source "$ROOT/scripts/lib/debs.sh"

TOOLS=(buildah podman runc conmon mmdebstrap patchelf)
DRIVER=${PDSERVE_STORAGE_DRIVER:-overlay}

if [[ $EUID -ne 0 ]]; then
    echo "buildah and podman run as root here (root's image storage): run as root" >&2
    exit 1
fi

# The tools, and the packages apt would add to this machine for them: their libraries
# that it lacks come along.
packages=$(for tool in "${TOOLS[@]}"; do echo "$tool=$(deb_version "$tool")"; done)
missing=$(
    apt-get install -s --no-install-recommends "${TOOLS[@]}" 2>/dev/null |
        sed -nE 's/^Inst ([^ ]+) (\[[^]]*\] )?\(([^ ]+) .*/\1=\3/p'
    echo "$packages"
)
missing=$(sort -u <<<"$missing")
key=$(sha256sum <<<"$missing" | cut -c1-12)
dir=$(deb_tree "container-tools-$key" $missing)
tree=$dir/root
bin=$dir/bin-$DRIVER
if [[ -x $bin/podman ]]; then
    echo "$bin"
    exit 0
fi

exec 7>"$dir/bin.lock"
flock 7
if [[ -x $bin/podman ]]; then
    echo "$bin"
    exit 0
fi
storage=$CACHE/containers/$DRIVER
libs=$tree/usr/lib/x86_64-linux-gnu
runc=$(ls "$tree"/usr/sbin/runc "$tree"/usr/bin/runc 2>/dev/null | head -n1)
for binary in "$tree"/usr/bin/{buildah,podman,conmon} "$runc"; do
    "$tree/usr/bin/patchelf" --set-rpath "$libs" "$binary"
done
mkdir -p "$bin.tmp" "$storage"
cat >"$bin.tmp/containers.conf" <<CONF
[containers]
seccomp_profile = "$tree/usr/share/containers/seccomp.json"

[network]
network_backend = "cni"
cni_plugin_dirs = ["$tree/usr/lib/cni"]
network_config_dir = "$storage/cni"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
conmon_path = ["$tree/usr/bin/conmon"]
runtime = "runc"

[engine.runtimes]
# crun 1.8 refuses the hybrid cgroup hierarchy of some machines; runc does not.
runc = ["$runc"]
CONF
cat >"$bin.tmp/storage.conf" <<CONF
[storage]
driver = "$DRIVER"
graphroot = "$storage/storage"
runroot = "/run/pdserve-containers-$DRIVER"
CONF
# No registry is configured: images are built from local bases or named in full.
echo 'unqualified-search-registries = []' >"$bin.tmp/registries.conf"
cp "$tree/etc/containers/policy.json" "$bin.tmp/policy.json"
for tool in buildah podman mmdebstrap; do
    cat >"$bin.tmp/$tool" <<WRAP
#!/bin/sh
export CONTAINERS_CONF="$bin/containers.conf" CONTAINERS_STORAGE_CONF="$bin/storage.conf"
export CONTAINERS_REGISTRIES_CONF="$bin/registries.conf"
export PATH="$tree/usr/bin:$tree/usr/sbin:\$PATH"
exec "$tree/usr/bin/$tool" "\$@"
WRAP
    chmod +x "$bin.tmp/$tool"
done
rm -rf "$bin"
mv "$bin.tmp" "$bin"
echo "$bin"
