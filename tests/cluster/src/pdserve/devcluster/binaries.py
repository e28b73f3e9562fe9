"""Where the control-plane binaries are, building them first when they are missing."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

BUILD_SCRIPT = Path("scripts") / "build-cluster.sh"
# A directory holding every binary below; when set, nothing is built.
BIN_DIR_ENV = "PDSERVE_CLUSTER_BIN"
NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")


B = TypeVar("B", bound="Binaries")


class BinariesError(RuntimeError):
    """The binaries are missing and could not be built."""


@dataclass(frozen=True)
class Binaries:
    """Paths of the executables the dev cluster runs."""

    bin_dir: Path
    names: ClassVar[tuple[str, ...]] = NAMES

    def path(self, name: str) -> Path:
        """The executable called `name` (one of `names`)."""
        if name not in self.names:
            raise KeyError(name)
        return self.bin_dir / name

    def missing(self) -> list[str]:
        """Names of the binaries that are not (executable) files."""
        return [n for n in self.names if not os.access(self.path(n), os.X_OK)]


def find_build_script(start: Path | None = None, script_path: Path = BUILD_SCRIPT) -> Path:
    """scripts/build-cluster.sh (or `script_path`) of the checkout holding this module
    (or `start`)."""
    # An editable install links this file from the checkout: resolve() finds the
    # checkout; the working directory is the fallback for other installs.
    candidates = [Path(__file__).resolve(), (start or Path.cwd()).resolve()]
    for origin in candidates:
        for folder in (origin, *origin.parents):
            script = folder / script_path
            if script.is_file():
                return script
    raise BinariesError(f"{script_path} not found above {candidates[0]} or {candidates[1]}")


def ensure_binaries(*, build: bool = True) -> Binaries:
    """The cluster binaries, built into the version-keyed cache if missing.

    The build script returns at once when everything is cached; a cold build takes
    tens of minutes. Set PDSERVE_CLUSTER_BIN to use binaries from elsewhere.
    """
    override = os.environ.get(BIN_DIR_ENV)
    if override:
        found = Binaries(Path(override))
        if found.missing():
            raise BinariesError(f"{BIN_DIR_ENV}={override} lacks {', '.join(found.missing())}")
        return found
    return built_by(find_build_script(), Binaries, build=build)


def built_by(script: Path, kind: type[B], *, build: bool) -> B:
    """The binaries `script` builds (or only checks, unless `build`): it prints their
    folder last."""
    # Progress of a cold build goes to stderr, straight to the user's terminal.
    args = [str(script)] if build else [str(script), "--check"]
    result = subprocess.run(args, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise BinariesError(f"{script} failed with exit status {result.returncode}")
    found = kind(Path(result.stdout.strip().splitlines()[-1]))
    if found.missing():
        raise BinariesError(f"{found.bin_dir} lacks {', '.join(found.missing())}")
    return found
