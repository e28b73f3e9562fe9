#!/usr/bin/env bash
# Prints a directory holding KEDA's CustomResourceDefinitions (ScaledObject and the
# rest), taken from the KEDA Go module's config/crd/bases (fetched through the Go
# module proxy, the only place KEDA's release is reachable from here) into
# ~/.cache/pdserve/keda-crds-<version>/ the first time. The operator's tests install
# them to check that the ScaledObjects it renders are accepted.
#
# Usage: scripts/ensure-keda-crds.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/go-build.sh
source "$ROOT/scripts/lib/go-build.sh"
KEDA_MODULE=github.com/kedacore/keda/v2
KEDA_VERSION=v2.21.0
DIR=$CACHE/keda-crds-$KEDA_VERSION

if [[ -f $DIR/keda.sh_scaledobjects.yaml ]]; then
    echo "$DIR"
    exit 0
fi
mkdir -p "$CACHE"
exec 9>"$DIR.lock"
flock 9
if [[ ! -f $DIR/keda.sh_scaledobjects.yaml ]]; then
    go_setup keda
    source_dir=$("$GO" mod download -json "$KEDA_MODULE@$KEDA_VERSION" |
        sed -nE 's/^[[:space:]]*"Dir": "(.*)",?$/\1/p')
    [[ -d $source_dir/config/crd/bases ]] || { echo "no CRDs in $source_dir" >&2; exit 1; }
    rm -rf "$DIR.partial"
    mkdir -p "$DIR.partial"
    cp "$source_dir"/config/crd/bases/keda.sh_*.yaml "$DIR.partial/"
    mv "$DIR.partial" "$DIR"
fi
echo "$DIR"
