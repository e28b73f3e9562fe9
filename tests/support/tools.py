"""Tools the tests run that the project builds or fetches into caches (Helm,
Prometheus, buildah and podman), found through the scripts that make them."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script_output(script: str, *args: str) -> Path:
    """The last line a script of scripts/ prints: the directory it made or found."""
    result = subprocess.run(
        [str(ROOT / "scripts" / script), *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"scripts/{script} failed:\n{result.stderr}")
    return Path(result.stdout.strip().splitlines()[-1])


@functools.cache
def helm() -> Path:
    """Helm, built from its Go module once per machine (minutes)."""
    return _script_output("build-helm.sh") / "helm"


@functools.cache
def promtool() -> Path:
    """Debian's promtool, unpacked once per machine."""
    return _script_output("ensure-prometheus.sh") / "promtool"


@functools.cache
def container_tools() -> Path:
    """The directory of the buildah and podman wrappers (root only)."""
    return _script_output("ensure-container-tools.sh")


@functools.cache
def prometheus() -> Path:
    """Debian's prometheus server, unpacked once per machine."""
    return _script_output("ensure-prometheus.sh") / "prometheus"
