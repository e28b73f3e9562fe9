"""Compiled builds of the router's hot modules, used where they match these sources.

`pdserve-native` (the workspace's `native/`) compiles some modules of this package
with mypyc, from these very files. Where it is installed and every module it compiled
is still byte for byte the source here, the packages holding them (`router`,
`network`) find those modules in its directory first; anywhere else (not installed,
built where no C compiler was, a source edited since it was built, or
`PDSERVE_PURE_PYTHON=1`) they run as the Python here. All or none: compiled modules
call each other directly, so one edited source turns them all back to Python.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import logging
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
PURE_PYTHON = "PDSERVE_PURE_PYTHON"  # set (non-empty): never the compiled modules


def unusable(sources: Mapping[str, str], compiled: Path, source_root: Path) -> str | None:
    """Why the modules compiled into `compiled` from `sources` (path under this
    package: SHA-256 of the source compiled) are not to be used with the sources under
    `source_root`; None when they are."""
    if not sources:
        return "nothing was compiled"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for module, digest in sources.items():
        if not (compiled / module).with_suffix(suffix).is_file():
            return f"no compiled {module} for this Python"
        source = source_root / module
        if not source.is_file() or hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            return f"{module} changed since it was compiled (`make venv` compiles it again)"
    return None


@cache
def _choice() -> tuple[Path | None, str]:
    """The directory of the compiled modules when they are to be used, and in words
    which build runs (and why, when it is the Python)."""
    if os.environ.get(PURE_PYTHON):
        return None, f"Python ({PURE_PYTHON} is set)"
    try:
        from pdserve import native
    except ImportError:
        return None, "Python (pdserve-native is not installed)"
    sources = native.built()
    if not sources:  # built where nothing could be compiled
        return None, "Python (pdserve-native was built without a C compiler)"
    root = Path(native.__file__).parent
    why = unusable(sources, root, HERE)
    if why is not None:
        log.warning("the router's modules run as Python: %s", why)
        return None, f"Python ({why})"
    return root, f"compiled ({len(sources)} modules)"


def compiled_root() -> Path | None:
    """The directory of the compiled modules, when they are to be used."""
    return _choice()[0]


def build_in_use() -> str:
    """Which build of the router's hot modules runs, for logs and `pdserve version`:
    `compiled (N modules)`, or `Python (why)`."""
    return _choice()[1]


def search_compiled(package: str, path: list[str]) -> None:
    """Make `package` (a subpackage of this one, by its `__name__`) find its compiled
    modules first, when they are used."""
    root = compiled_root()
    if root is not None:
        path.insert(0, str(root.joinpath(*package.split(".")[2:])))
