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
MODULES=$ROOT/tests/cluster
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pdserve
BINARIES=(kube-apiserver etcd kwok kube-controller-manager kube-scheduler kubectl)

# The version of a required module, read from a wrapper's go.mod (single source of truth).
module_version() {
    local version
    version=$(sed -nE "s#^(require)?[[:space:]]*$2 (v[^ ]+).*#\2#p" "$MODULES/$1/go.mod" | head -n1)
    [[ -n $version ]] || { echo "no version of $2 in $MODULES/$1/go.mod" >&2; exit 1; }
    echo "$version"
}

K8S_VERSION=$(module_version k8s k8s.io/kubernetes)
ETCD_VERSION=$(module_version etcd go.etcd.io/etcd/server/v3)
KWOK_VERSION=$(module_version kwok sigs.k8s.io/kwok)
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

GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
[[ -x $GO ]] || { echo "go not found: install Go >= 1.26 or set GO=/path/to/go" >&2; exit 1; }
PRIVATE_GOCACHE=${GOCACHE:+no}
export GOMODCACHE=${GOMODCACHE:-$CACHE/go/mod}
export GOCACHE=${GOCACHE:-$CACHE/go/build}
# -modcacherw: a plain `rm -rf` can clear the cache. -buildvcs=false: the wrapper
# modules live inside this checkout, whose state says nothing about the upstreams.
export GOFLAGS="-modcacherw -buildvcs=false"
export GOTOOLCHAIN=local CGO_ENABLED=0
LOG_FILE=$BIN_DIR/../build-times.txt

# Module metadata from the Go module proxy: {{.Time}} and the tagged commit, if known.
module_field() {
    (cd "$MODULES/$1" && "$GO" list -m -f "$3" "$2")
}

k8s_ldflags() {
    local date major minor flags="-s -w" pkg key value
    date=$(module_field k8s k8s.io/kubernetes '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}')
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
    sha=$(module_field etcd go.etcd.io/etcd/server/v3 '{{with .Origin}}{{.Hash}}{{end}}' || true)
    echo "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=${sha:-$ETCD_VERSION}"
}

kwok_ldflags() {
    echo "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
}

# build NAME MODULE PACKAGE LDFLAGS: builds into a temporary file and renames it, so
# an interrupted build never leaves a binary that looks complete.
build() {
    local name=$1 module=$2 package=$3 ldflags=$4 start seconds
    [[ -x $BIN_DIR/$name ]] && return 0
    echo "building $name ($package)" >&2
    start=$(date +%s)
    (cd "$MODULES/$module" &&
        nice -n 10 "$GO" build -trimpath -ldflags "$ldflags" -o "$BIN_DIR/.$name.tmp" "$package")
    mv -f "$BIN_DIR/.$name.tmp" "$BIN_DIR/$name"
    seconds=$(($(date +%s) - start))
    echo "built $name in ${seconds}s" >&2
    echo "$name ${seconds}s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$LOG_FILE"
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
echo "total $(($(date +%s) - BUILD_START))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$LOG_FILE"
if [[ ${PRIVATE_GOCACHE:-yes} == yes && ${KEEP_GOCACHE:-0} != 1 ]]; then
    "$GO" clean -cache
fi
echo "$BIN_DIR"
