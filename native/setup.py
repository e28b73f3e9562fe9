"""Builds pdserve-native: the modules of pdserve-workers that MODULES names, compiled
to C by mypyc from the workspace's sources (../workers/src), as one shared library
and a small extension per module under `pdserve/native/<package>/`. Beside them,
`pdserve/native/built.json` records each source's SHA-256: pdserve-workers uses the
compiled modules only while its sources are exactly these.

Without a C compiler or Python's headers the wheel holds no compiled module (and the
modules run as Python)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
WORKERS = HERE.parent / "workers" / "src" / "pdserve" / "workers"
# Per request, the router's path through these is most of its Python: parsing and
# answering HTTP/1.1, choosing and forwarding, the upstream client, the SSE count, the
# KV block keys and lookups, the tallies. (Not `workers`, `metrics`, `kv_metrics`: tests
# replace what they call.)
MODULES = [
    "network/http1.py",
    "router/app.py",
    "router/kv_index.py",
    "router/kv_keys.py",
    "router/kv_scoring.py",
    "router/outcome.py",
    "router/proxy.py",
    "router/routes.py",
    "router/sse.py",
    "router/tallies.py",
    "router/upstream.py",
]
GROUP = "pdserve.native.hot"  # the shared library: pdserve/native/hot__mypyc.*.so


def can_compile() -> str | None:
    """Why nothing can be compiled here, or None."""
    if os.environ.get("PDSERVE_NO_COMPILE"):
        return "PDSERVE_NO_COMPILE is set"
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[:1]
    if not compiler or shutil.which(compiler[0]) is None:
        return f"no C compiler ({' '.join(compiler) or 'CC unset'})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return "no Python.h"
    return None


def extensions() -> list[object]:
    from mypyc.build import mypycify

    os.chdir(HERE)  # mypyc.ini's paths, and mypyc's build/ directory
    built = mypycify(
        ["--config-file", "mypyc.ini", *(str(WORKERS / module) for module in MODULES)],
        group_name=GROUP,
        opt_level="3",
    )
    for extension in built:
        # Each module's extension lies under pdserve/native/ (the package's own name is
        # kept inside it): pdserve.workers.router.sse -> pdserve.native.router.sse.
        if extension.name.startswith("pdserve.workers."):
            extension.name = "pdserve.native." + extension.name.removeprefix("pdserve.workers.")
    return built


def record() -> None:
    digests = {module: hashlib.sha256((WORKERS / module).read_bytes()).hexdigest()
               for module in MODULES}  # fmt: skip
    target = HERE / "src" / "pdserve" / "native" / "built.json"
    target.write_text(json.dumps({"group": GROUP, "sources": digests}, indent=1) + "\n")


# setuptools runs this file for each step of a build; only building compiles (asking
# for the build's requirements does not).
building = any(argument.startswith(("bdist", "build")) for argument in sys.argv[1:])
why_not = can_compile()
if not building:
    ext_modules = []
elif why_not is None:
    # A build directory left from an earlier build would put modules compiled then
    # (perhaps no longer in MODULES) into this wheel.
    shutil.rmtree(HERE / "build", ignore_errors=True)
    record()
    ext_modules = extensions()
else:
    print(f"pdserve-native: nothing compiled ({why_not}); the modules run as Python",
          file=sys.stderr)  # fmt: skip
    (HERE / "src" / "pdserve" / "native" / "built.json").unlink(missing_ok=True)
    ext_modules = []

setup(ext_modules=ext_modules, package_data={"pdserve.native": ["built.json"]})
