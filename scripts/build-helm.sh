#!/usr/bin/env bash
# Builds Helm from its Go module (the wrapper in tests/cluster/helm pins the version)
# into a cache outside the checkout: ~/.cache/pdserve/helm-<version>/bin/helm.
#
# Idempotent: when the binary is there it returns at once. Progress goes to stderr; the
# last line on stdout is the bin directory.
#
# Usage: scripts/build-helm.sh [--check]
#   --check   build nothing; exit 1 when Helm is missing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/go-build.sh
source "$ROOT/scripts/lib/go-build.sh"
MODULE=$ROOT/tests/cluster/helm
HELM_MODULE=helm.sh/helm/v4
HELM_VERSION=$(module_version "$MODULE" "$HELM_MODULE")
BIN_DIR=$CACHE/helm-$HELM_VERSION/bin

if [[ -x $BIN_DIR/helm ]]; then
    echo "$BIN_DIR"
    exit 0
fi
if [[ ${1:-} == --check ]]; then
    echo "Helm $HELM_VERSION not built yet: run $0 (minutes, once)" >&2
    exit 1
fi

mkdir -p "$BIN_DIR"
exec 9>"$BIN_DIR/../build.lock"
flock 9
if [[ -x $BIN_DIR/helm ]]; then
    echo "$BIN_DIR"
    exit 0
fi

go_setup helm
# As Helm's Makefile stamps a release: without the version Helm calls itself "v4.3",
# and `helm version` is what users compare with the chart's requirements.
commit=$(module_field "$MODULE" "$HELM_MODULE" '{{with .Origin}}{{.Hash}}{{end}}' || true)
ldflags="-s -w -X $HELM_MODULE/internal/version.version=$HELM_VERSION"
ldflags+=" -X $HELM_MODULE/internal/version.gitCommit=$commit"
ldflags+=" -X $HELM_MODULE/internal/version.gitTreeState=clean"
go_build "$BIN_DIR" helm "$MODULE" "$HELM_MODULE/cmd/helm" "$ldflags"
go_clean_private_cache
echo "$BIN_DIR"
