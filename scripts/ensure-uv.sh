#!/usr/bin/env bash
# Prints the path of uv at the version this project pins, installing it from PyPI
# (pip, into a small environment of its own) when this machine lacks it. The copy is
# cached outside the checkout, keyed by version, and shared by every checkout: it is
# never changed once made.
#
# Usage: scripts/ensure-uv.sh VERSION [PYTHON]
set -euo pipefail
version=$1 python=${2:-python3}

if command -v uv >/dev/null 2>&1 && [[ $(uv --version) == "uv $version"* ]]; then
    command -v uv
    exit 0
fi
cache=${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/tools
dir=$cache/uv-$version
if [[ ! -x $dir/bin/uv ]]; then
    mkdir -p "$cache"
    exec 9>"$dir.lock"
    flock 9
    if [[ ! -x $dir/bin/uv ]]; then
        echo "installing uv $version from PyPI into $dir" >&2
        rm -rf "$dir.tmp"
        "$python" -m venv "$dir.tmp"
        "$dir.tmp/bin/pip" install -q --disable-pip-version-check "uv==$version" >&2
        mv "$dir.tmp" "$dir"
    fi
fi
echo "$dir/bin/uv"
