#!/usr/bin/env bash
# Makes this checkout's .venv match the committed uv.lock: the three parts of pdserve
# (editable) and the dev tools. Each checkout has its own .venv; uv's cache (hard
# links) makes a second one cheap. The interpreter is the machine's own python3.
# Dependencies are compiled to bytecode once, at install: otherwise every process
# compiles what it imports (torch alone: thousands of modules, seconds of CPU) each
# time it starts wherever bytecode is not written back (PYTHONDONTWRITEBYTECODE, or
# a read-only tree), and the tests start hundreds of processes.
#
# Usage: scripts/sync-venv.sh UV_VERSION [PYTHON]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
uv=$(scripts/ensure-uv.sh "$@")
export UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=.venv
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$uv" sync --locked --compile-bytecode --python "${2:-python3}" --quiet >"$log" 2>&1; then
    cat "$log" >&2
    if grep -q "needs to be updated" "$log"; then
        echo "uv.lock does not match the pyproject.toml files: run \`make lock\`" \
            "and commit uv.lock" >&2
    fi
    exit 1
fi
