#!/usr/bin/env bash
# Builds pdserve's container images with buildah, on a base image made locally from
# Debian's packages (mmdebstrap: no registry is needed), and prints the reference of
# each image built, one per line (the last lines on stdout).
#
# Cached: the base by its Debian release and package list, each image by the content
# of what it is built from (tagged src-<hash>); a second run with nothing changed
# builds nothing. Build times go to ~/.cache/pdserve/containers/build-times.txt.
#
# Usage: scripts/build-images.sh [operator] [worker]    (default: both)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pdserve
# A caller that has the tools' directory already (what ensure-container-tools.sh
# prints) passes it in PDSERVE_CONTAINER_TOOLS: finding it asks apt about every
# package, seconds of CPU.
TOOLS=${PDSERVE_CONTAINER_TOOLS:-$("$ROOT/scripts/ensure-container-tools.sh")}
POLICY=(--signature-policy "$TOOLS/policy.json")
LOG=$CACHE/containers/build-times.txt
# This machine's CA bundle, for the steps that download (see the Containerfiles).
CA_BUNDLE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
SECRET=()
[[ -s $CA_BUNDLE ]] && SECRET=(--secret "id=ca,src=$CA_BUNDLE")
VERSION=$(sed -nE 's/^version = "(.*)"/\1/p' "$ROOT/cli/pyproject.toml")

# The base: Debian's python3 and nothing more (no recommended packages, docs,
# manuals or translations). The build base adds what compiling the router's hot
# modules needs (pdserve-native: mypyc's C, built in the worker image's build stage
# only, so the image itself carries no compiler).
DEBIAN_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
BUILD_PACKAGES=$BASE_PACKAGES,gcc,libc6-dev,python3-dev
# The merged-usr hook makes /bin, /lib... links into /usr itself: Debian's usrmerge
# package would bring perl (50 MB) along.
COMMON_OPTIONS=(--aptopt='APT::Install-Recommends "false"'
    "--hook-dir=$TOOLS/../root/usr/share/mmdebstrap/hooks/merged-usr"
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*')
BASE_OPTIONS=(--variant=minbase "--include=$BASE_PACKAGES" "${COMMON_OPTIONS[@]}")
BUILD_OPTIONS=(--variant=minbase "--include=$BUILD_PACKAGES" "${COMMON_OPTIONS[@]}")
BASE_IMAGE=localhost/pdserve-base:$DEBIAN_SUITE-$(echo "${BASE_OPTIONS[*]}" | sha256sum | cut -c1-12)
BUILD_IMAGE=localhost/pdserve-build-base:$DEBIAN_SUITE-$(echo "${BUILD_OPTIONS[*]}" | sha256sum | cut -c1-12)

image_exists() {
    "$TOOLS/podman" image exists "$1"
}

log_time() {
    echo "$1 $(($(date +%s) - $2))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$LOG"
}

# build_base IMAGE OPTION...: IMAGE made by mmdebstrap with those options, unless it
# exists.
build_base() {
    local image=$1 started tarball old
    shift
    image_exists "$image" && return 0
    started=$(date +%s)
    echo "building $image from Debian $DEBIAN_SUITE (mmdebstrap)" >&2
    mkdir -p "$CACHE/containers"
    tarball=$(mktemp "$CACHE/containers/base.XXXXXX.tar")
    "$TOOLS/mmdebstrap" --quiet "$@" "$DEBIAN_SUITE" "$tarball" >&2
    "$TOOLS/podman" import "${POLICY[@]}" --quiet "$tarball" "$image" >/dev/null
    rm -f "$tarball"
    log_time "$(basename "${image%%:*}")" "$started"
    # Bases made with other options, and the layers built on them, are of no more use.
    for old in $("$TOOLS/podman" images --format '{{.Repository}}:{{.Tag}}' "${image%%:*}"); do
        [[ $old != "$image" ]] && "$TOOLS/podman" rmi --force "$old" >/dev/null
    done
    "$TOOLS/podman" image prune --force >/dev/null
}

# The files an image is built from (tracked or new, not ignored), hashed with the
# Containerfile and the base.
source_hash() {
    local name=$1 part=$2
    (
        cd "$ROOT"
        echo "$BASE_IMAGE"
        [[ $name == worker ]] && echo "$BUILD_IMAGE" # its build stage's base
        git ls-files -co --exclude-standard -- pyproject.toml uv.lock '*/pyproject.toml' \
            base/src protocol/src cli/src "$part/src" "images/$name" "${@:3}" | sort -u |
            xargs sha256sum
    ) | sha256sum | cut -c1-16
}

# build NAME PART REPOSITORY [PATH...]: the image of the workspace project in PART
# (and the other sources it is built from, PATH...).
build() {
    local name=$1 part=$2 repository=$3 source started old
    source=$repository:src-$(source_hash "$name" "$part" "${@:4}")
    if ! image_exists "$source"; then
        started=$(date +%s)
        echo "building $repository:$VERSION" >&2
        "$TOOLS/buildah" bud "${POLICY[@]}" --pull=never --isolation chroot --layers --force-rm "${SECRET[@]}" \
            --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "BUILD_IMAGE=$BUILD_IMAGE" -f "images/$name/Containerfile" \
            -t "$source" "$ROOT" >&2
        log_time "$name" "$started"
        # Older builds of this image are no longer wanted.
        for old in $("$TOOLS/podman" images --format '{{.Repository}}:{{.Tag}}' "$repository"); do
            [[ $old == "$repository:src-"* && $old != "$source" ]] &&
                "$TOOLS/podman" rmi "$old" >/dev/null
        done
    fi
    "$TOOLS/podman" tag "$source" "$repository:$VERSION"
    echo "$repository:$VERSION"
}

cd "$ROOT"
build_base "$BASE_IMAGE" "${BASE_OPTIONS[@]}"
for name in "${@:-operator worker}"; do
    for name in $name; do
        case $name in
        operator) build operator operator localhost/pdserve-operator ;;
        worker)
            build_base "$BUILD_IMAGE" "${BUILD_OPTIONS[@]}"
            build worker workers localhost/pdserve native
            ;;
        *) echo "unknown image $name (operator, worker)" >&2; exit 2 ;;
        esac
    done
done
