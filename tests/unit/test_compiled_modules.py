"""The router's compiled modules (pdserve-native) are used only where they were built
from exactly the sources here, and the Python modules remain the fallback."""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.workers.compiled import PURE_PYTHON, unusable

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
WHERE = (
    "import json, sys; from pdserve import native; import importlib; "
    "print(json.dumps({m: importlib.import_module('pdserve.workers.' + m[:-3].replace('/', '.'))"
    ".__file__ for m in native.built()}))"
)


def _tree(tmp_path: Path, text: bytes) -> tuple[dict[str, str], Path, Path]:
    sources, compiled = tmp_path / "src", tmp_path / "compiled"
    (sources / "router").mkdir(parents=True)
    (compiled / "router").mkdir(parents=True)
    (sources / "router" / "sse.py").write_bytes(text)
    (compiled / "router" / f"sse{SUFFIX}").write_bytes(b"")
    return {"router/sse.py": hashlib.sha256(text).hexdigest()}, compiled, sources


def test_compiled_modules_are_used_only_with_the_sources_they_were_built_from(
    tmp_path: Path,
) -> None:
    built, compiled, sources = _tree(tmp_path, b"x = 1\n")
    assert unusable(built, compiled, sources) is None
    (sources / "router" / "sse.py").write_bytes(b"x = 2\n")  # edited since
    assert "changed" in str(unusable(built, compiled, sources))
    (sources / "router" / "sse.py").write_bytes(b"x = 1\n")
    (compiled / "router" / f"sse{SUFFIX}").unlink()  # built for another Python
    assert "no compiled" in str(unusable(built, compiled, sources))
    assert unusable({}, compiled, sources) is not None  # nothing compiled (no compiler)


def _files(env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, check=True
    )
    files: dict[str, str] = json.loads(done.stdout)
    return files


def test_the_python_modules_run_where_asked_and_the_compiled_ones_otherwise() -> None:
    native = pytest.importorskip("pdserve.native")
    if not native.built():
        pytest.skip("pdserve-native was built without a C compiler: nothing compiled")
    pure = _files({**os.environ, PURE_PYTHON: "1"})
    assert pure and all(file.endswith(".py") for file in pure.values()), pure
    compiled = _files({key: value for key, value in os.environ.items() if key != PURE_PYTHON})
    assert all(file.endswith(SUFFIX) for file in compiled.values()), compiled


def _build_named(env: dict[str, str]) -> str:
    code = "from pdserve.workers.compiled import build_in_use; print(build_in_use())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_build_in_use_is_named_with_the_reason_for_python() -> None:
    native = pytest.importorskip("pdserve.native")
    assert _build_named({**os.environ, PURE_PYTHON: "1"}) == f"Python ({PURE_PYTHON} is set)"
    others = {key: value for key, value in os.environ.items() if key != PURE_PYTHON}
    expected = f"compiled ({len(native.built())} modules)" if native.built() else "Python ("
    assert _build_named(others).startswith(expected)
