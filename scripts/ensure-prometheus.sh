#!/usr/bin/env bash
# Prints the directory holding Debian's `prometheus` and `promtool`, fetching the
# package (apt-get download, dpkg -x: no root, nothing installed) into
# ~/.cache/pdserve/prometheus-<version>/ the first time.
#
# Usage: scripts/ensure-prometheus.sh
#   "$(scripts/ensure-prometheus.sh)/promtool" check rules rules.yaml
#   "$(scripts/ensure-prometheus.sh)/prometheus" --config.file=... --storage.tsdb.path=...
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/debs.sh
source "$ROOT/scripts/lib/debs.sh"

version=$(deb_version prometheus)
dir=$(deb_tree "prometheus-$version" "prometheus=$version")
echo "$dir/root/usr/bin"
