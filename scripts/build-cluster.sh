#!/usr/bin/env bash
# Builds the binaries of the local Kubernetes control plane (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok) from the Go wrapper modules
# in tests/cluster/, into a cache outside the checkout keyed by the upstream versions.
#
# Idempotent: when every binary is already there it returns at once. Progress goes to
# stderr; the last line on stdout is the bin directory.
#
# Usage: scripts/build-cluster.sh [--check]
#   --check   build nothing; exit 1 when a binary is missing
#
# Environment: GO (the go command), XDG_CACHE_HOME, GOMODCACHE and GOCACHE (default
# under the pdserve cache, so `rm -rf ~/.cache/pdserve` removes everything).
# The private build cache (about 4 GB) is emptied after a complete build, as the
# binaries are what is kept; KEEP_GOCACHE=1 keeps it. The module cache (about 1 GB,
# 190 MB downloaded) stays, so a rebuild needs no network.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/go-build.sh
source "$ROOT/scripts/lib/go-build.sh"
MODULES=$ROOT/tests/cluster
BINARIES=(kube-apiserver etcd kwok kube-controller-manager kube-scheduler kubectl)

K8S_VERSION=$(module_version "$MODULES/k8s" k8s.io/kubernetes)
ETCD_VERSION=$(module_version "$MODULES/etcd" go.etcd.io/etcd/server/v3)
KWOK_VERSION=$(module_version "$MODULES/kwok" sigs.k8s.io/kwok)
BIN_DIR=$CACHE/cluster/k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}/bin

all_built() {
    local name
    for name in "${BINARIES[@]}"; do
        [[ -x $BIN_DIR/$name ]] || return 1
    done
}

if all_built; then
    echo "$BIN_DIR"
    exit 0
fi
if [[ ${1:-} == --check ]]; then
    echo "not built yet: run $0 (tens of minutes, once)" >&2
    exit 1
fi

mkdir -p "$BIN_DIR"
# Two callers (a test session and `make cluster`) may start at once: one builds.
exec 9>"$BIN_DIR/../build.lock"
flock 9
if all_built; then
    echo "$BIN_DIR"
    exit 0
fi

go_setup cluster

k8s_ldflags() {
    local date major minor flags="-s -w" pkg key value
    date=$(module_field "$MODULES/k8s" k8s.io/kubernetes '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}')
    major=${K8S_VERSION#v}
    major=${major%%.*}
    minor=${K8S_VERSION#v*.}
    minor=${minor%%.*}
    # Without these the servers report v0.0.0-master, which breaks version checks
    # (Helm kubeVersion, client/server skew warnings).
    for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
        for key in gitVersion=$K8S_VERSION gitMajor=$major gitMinor=$minor \
            gitTreeState=clean buildDate=$date; do
            value=${key#*=}
            flags+=" -X $pkg.${key%%=*}=$value"
        done
    done
    echo "$flags"
}

etcd_ldflags() {
    local sha
    sha=$(module_field "$MODULES/etcd" go.etcd.io/etcd/server/v3 '{{with .Origin}}{{.Hash}}{{end}}' || true)
    echo "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=${sha:-$ETCD_VERSION}"
}

kwok_ldflags() {
    echo "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
}

# build NAME MODULE PACKAGE LDFLAGS
build() {
    go_build "$BIN_DIR" "$1" "$MODULES/$2" "$3" "$4"
}

echo "building cluster binaries into $BIN_DIR (first time only; tens of minutes)" >&2
BUILD_START=$(date +%s)
K8S_LDFLAGS=$(k8s_ldflags)
build kube-apiserver k8s k8s.io/kubernetes/cmd/kube-apiserver "$K8S_LDFLAGS"
build etcd etcd go.etcd.io/etcd/server/v3 "$(etcd_ldflags)"
build kwok kwok sigs.k8s.io/kwok/cmd/kwok "$(kwok_ldflags)"
build kube-controller-manager k8s k8s.io/kubernetes/cmd/kube-controller-manager "$K8S_LDFLAGS"
build kube-scheduler k8s k8s.io/kubernetes/cmd/kube-scheduler "$K8S_LDFLAGS"
build kubectl k8s k8s.io/kubernetes/cmd/kubectl "$K8S_LDFLAGS"
echo "total $(($(date +%s) - BUILD_START))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$BIN_DIR/../build-times.txt"
go_clean_private_cache
echo "$BIN_DIR"
