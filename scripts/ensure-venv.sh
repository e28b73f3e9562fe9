#!/usr/bin/env bash
# Create (once per dependency key) the cached virtual environment, link it as .venv,
# and make sure this checkout is the one installed in it (editable, strict mode).
set -euo pipefail
python=$1 venv_dir=$2 link=$3
here=$(pwd -P)

# One creation at a time: concurrent `make` runs would otherwise delete each other's
# half-made environment.
mkdir -p "$(dirname "$venv_dir")"
exec 9>"$venv_dir.lock"
flock 9

# A strict editable install links files, so a new module needs a new link tree: the
# key covers the checkout's place and its list of modules, taken before installing.
files_key=$( (echo "$here"; find cli operator workers -name '*.py' -o -name py.typed | sort) \
    | sha256sum | cut -c1-16)

if [ ! -x "$venv_dir/bin/python" ] || [ ! -f "$venv_dir/.deps-ok" ]; then
    echo "creating virtual environment in $venv_dir"
    rm -rf "$venv_dir"
    "$python" -m venv "$venv_dir"
    "$venv_dir/bin/pip" install -q --upgrade pip setuptools wheel
    "$venv_dir/bin/pip" install -q -e ".[dev,nixl]" --config-settings editable_mode=strict
    touch "$venv_dir/.deps-ok"
    echo "$files_key" > "$venv_dir/.checkout-key"
fi
ln -sfn "$venv_dir" "$link"

if [ "$(cat "$venv_dir/.checkout-key" 2>/dev/null)" != "$files_key" ] \
    || ! ls -d build/__editable__.pdserve-* >/dev/null 2>&1; then
    log=$(mktemp)
    if ! "$venv_dir/bin/pip" install -q --no-deps --no-build-isolation -e . \
        --config-settings editable_mode=strict >"$log" 2>&1; then
        cat "$log"; rm -f "$log"; exit 1
    fi
    rm -f "$log"
    echo "$files_key" > "$venv_dir/.checkout-key"
fi
