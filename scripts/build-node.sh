#!/usr/bin/env bash
# Builds what a real node of the local dev cluster runs, into a cache outside the
# checkout keyed by the upstream versions: kubelet and kube-proxy (the control plane's
# Kubernetes release, same wrapper module), containerd 2.x with its runc shim and ctr,
# the CNI plugins, CoreDNS (the plugins the node uses only) and kube-network-policies,
# from the Go wrapper modules in tests/cluster/; runc, iptables and nftables from
# Debian's packages (downloaded and unpacked, nothing installed), behind wrappers that
# find their libraries.
#
# Idempotent: when everything is there it returns at once. Progress goes to stderr;
# the last line on stdout is the bin directory.
#
# Usage: scripts/build-node.sh [--check]
#   --check   build nothing; exit 1 when something is missing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/go-build.sh
source "$ROOT/scripts/lib/go-build.sh"
# shellcheck source=lib/debs.sh
source "$ROOT/scripts/lib/debs.sh"
MODULES=$ROOT/tests/cluster
GO_BINARIES=(kubelet kube-proxy containerd containerd-shim-runc-v2 ctr bridge host-local loopback
    portmap coredns kube-network-policies pause)
WRAPPED=(runc iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore nft)
# Debian's packages of the tools the node drives (runc for containerd; iptables for
# kube-proxy and portmap; nft for checking kube-network-policies' rules), with the
# libraries they need that a minimal machine lacks (and patchelf, for runc).
DEBS=(runc iptables nftables libip4tc2 libip6tc2 libxtables12 libnftables1 libnftnl11 libmnl0
    libnetfilter-conntrack3 libnfnetlink0 libjansson4 libedit2 libbsd0 libmd0 libgmp10 libseccomp2
    patchelf)

K8S_VERSION=$(module_version "$MODULES/k8s" k8s.io/kubernetes)
CONTAINERD_VERSION=$(module_version "$MODULES/containerd" github.com/containerd/containerd/v2)
CNI_VERSION=$(module_version "$MODULES/cni" github.com/containernetworking/plugins)
COREDNS_VERSION=$(module_version "$MODULES/coredns" github.com/coredns/coredns)
NETPOL_VERSION=$(module_version "$MODULES/netpol" sigs.k8s.io/kube-network-policies)
KEY=k8s-${K8S_VERSION}_containerd-${CONTAINERD_VERSION}_cni-${CNI_VERSION}_coredns-${COREDNS_VERSION}_netpol-${NETPOL_VERSION}
BIN_DIR=$CACHE/node/$KEY/bin

all_built() {
    local name
    for name in "${GO_BINARIES[@]}" "${WRAPPED[@]}"; do
        [[ -x $BIN_DIR/$name ]] || return 1
    done
}

if all_built; then
    echo "$BIN_DIR"
    exit 0
fi
if [[ ${1:-} == --check ]]; then
    echo "node not built yet: run $0 (tens of minutes, once)" >&2
    exit 1
fi

mkdir -p "$BIN_DIR"
exec 9>"$BIN_DIR/../build.lock"
flock 9
if all_built; then
    echo "$BIN_DIR"
    exit 0
fi

go_setup node

# The same stamping as the control plane's (scripts/build-cluster.sh): kubelet reports
# its version to the API server, which checks the skew.
k8s_ldflags() {
    local major minor flags="-s -w" pkg key
    major=${K8S_VERSION#v}
    major=${major%%.*}
    minor=${K8S_VERSION#v*.}
    minor=${minor%%.*}
    for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
        for key in gitVersion=$K8S_VERSION gitMajor=$major gitMinor=$minor gitTreeState=clean; do
            flags+=" -X $pkg.${key%%=*}=${key#*=}"
        done
    done
    echo "$flags"
}

build() {
    go_build "$BIN_DIR" "$1" "$MODULES/$2" "$3" "$4"
}

# wrap NAME TREE PATH: a script running TREE/PATH with TREE's libraries (and
# iptables' extensions, which it looks for where Debian installs them).
wrap() {
    local libs=$2/usr/lib/x86_64-linux-gnu:$2/lib/x86_64-linux-gnu
    printf '#!/bin/sh\nexport XTABLES_LIBDIR=%s\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
        "$2/usr/lib/x86_64-linux-gnu/xtables" "$libs" "$2/$3" >"$BIN_DIR/.$1.tmp"
    chmod +x "$BIN_DIR/.$1.tmp"
    mv -f "$BIN_DIR/.$1.tmp" "$BIN_DIR/$1"
}

# kube-network-policies from its module, with one change (tests/cluster/netpol/patch/):
# its rules queue packets through the xtables NFQUEUE target instead of nftables'
# `queue` statement, which kernels without CONFIG_NFT_QUEUE (these machines) lack.
build_netpol() {
    local source=$BIN_DIR/../src/kube-network-policies module=$BIN_DIR/../src/netpol-module
    local origin
    [[ -x $BIN_DIR/kube-network-policies ]] && return 0
    (cd "$MODULES/netpol" && "$GO" mod download sigs.k8s.io/kube-network-policies)
    origin=$(cd "$MODULES/netpol" && "$GO" list -m -f '{{.Dir}}' sigs.k8s.io/kube-network-policies)
    rm -rf "$source" "$module"
    mkdir -p "$source" "$module"
    cp -r "$origin/." "$source/"
    chmod -R u+w "$source"
    cp "$MODULES/netpol/patch/nfqueue_compat.go" "$source/pkg/networkpolicy/"
    sed -i -e 's/queue := &expr.Queue{Num: uint16(c.config.QueueID)}/queue := nfqueueTarget(uint16(c.config.QueueID), c.config.FailOpen)/' \
        -e '/queue.Flag = expr.QueueFlagBypass/d' "$source/pkg/networkpolicy/controller.go"
    sed -i 's/&expr.Queue{Num: uint16(n.nfQueueID), Flag: expr.QueueFlagBypass}/nfqueueTarget(uint16(n.nfQueueID), true)/' \
        "$source/pkg/networkpolicy/dnsagent.go"
    if grep -rq 'expr.Queue' "$source/pkg"; then
        echo "kube-network-policies: the NFQUEUE change no longer applies; update build_netpol" >&2
        exit 1
    fi
    cp "$MODULES/netpol/go.mod" "$MODULES/netpol/go.sum" "$module/"
    (cd "$module" && "$GO" mod edit -replace "sigs.k8s.io/kube-network-policies=$source")
    go_build "$BIN_DIR" kube-network-policies "$module" sigs.k8s.io/kube-network-policies/cmd "-s -w"
}

echo "building the node's binaries into $BIN_DIR (first time only; tens of minutes)" >&2
BUILD_START=$(date +%s)
packages=()
for deb in "${DEBS[@]}"; do
    packages+=("$deb=$(deb_version "$deb")")
done
tree=$(deb_tree "node-debs-$(sha256sum <<<"${packages[*]}" | cut -c1-12)" "${packages[@]}")/root
# runc runs itself again (`runc init`) with an environment of its own: it finds its
# libraries through its RUNPATH, not LD_LIBRARY_PATH.
cp "$tree/usr/sbin/runc" "$BIN_DIR/.runc.tmp"
"$tree/usr/bin/patchelf" --set-rpath "$tree/usr/lib/x86_64-linux-gnu:$tree/lib/x86_64-linux-gnu" "$BIN_DIR/.runc.tmp"
mv -f "$BIN_DIR/.runc.tmp" "$BIN_DIR/runc"
# kube-proxy's iptables mode on the kernel's nf_tables, as current distributions do.
for name in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    wrap "$name" "$tree" "usr/sbin/${name/tables/tables-nft}"
done
wrap nft "$tree" usr/sbin/nft

CONTAINERD_FLAGS="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
K8S_LDFLAGS=$(k8s_ldflags)
build kubelet k8s k8s.io/kubernetes/cmd/kubelet "$K8S_LDFLAGS"
build kube-proxy k8s k8s.io/kubernetes/cmd/kube-proxy "$K8S_LDFLAGS"
build containerd containerd github.com/containerd/containerd/v2/cmd/containerd "$CONTAINERD_FLAGS"
build containerd-shim-runc-v2 containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 "$CONTAINERD_FLAGS"
build ctr containerd github.com/containerd/containerd/v2/cmd/ctr "$CONTAINERD_FLAGS"
for plugin in main/bridge main/loopback ipam/host-local meta/portmap; do
    build "${plugin#*/}" cni "github.com/containernetworking/plugins/plugins/$plugin" "-s -w"
done
build coredns coredns pdserve.local/cluster/coredns "-s -w"
build_netpol
build pause pause pdserve.local/cluster/pause "-s -w"
echo "total $(($(date +%s) - BUILD_START))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$BIN_DIR/../build-times.txt"
go_clean_private_cache
echo "$BIN_DIR"
