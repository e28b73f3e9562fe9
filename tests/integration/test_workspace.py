"""The workspace's promises: each part installs on its own with only its own
dependencies, and the processes pdserve starts run this checkout's code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdserve.base.process import pdserve_command
from support.worker import running_worker

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "nixl", "triton", "nvidia-")


def locked_closure(package: str) -> set[str]:
    """Every package `package` needs, from uv.lock."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    by_name = {entry["name"]: entry for entry in lock["package"]}
    seen: set[str] = set()
    todo = [package]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(dep["name"] for dep in by_name[name].get("dependencies", []))
    return seen


def test_the_operator_needs_no_torch_and_the_workers_no_kopf() -> None:
    operator = locked_closure("pdserve-operator")
    assert "kopf" in operator and "kubernetes" in operator
    assert not [name for name in operator if name.startswith(HEAVY)]
    workers = locked_closure("pdserve-workers")
    assert "torch" in workers and "nixl" in workers
    assert "kopf" not in workers and "cryptography" not in workers
    # What the router, the server and the operator share loads neither.
    shared = locked_closure("pdserve-protocol") | locked_closure("pdserve-base")
    assert "kopf" not in shared and not [name for name in shared if name.startswith(HEAVY)]
    assert locked_closure("pdserve-base") == {"pdserve-base"}


def uv() -> str:
    """The uv this project pins (as `make` uses it)."""
    version = re.search(r"^UV_VERSION := (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert version is not None
    found = subprocess.run(
        [ROOT / "scripts" / "ensure-uv.sh", version[1]], capture_output=True, text=True, check=True
    )
    return found.stdout.strip()


@pytest.fixture(scope="module")
def operator_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An environment with the operator's package and its dependencies only, as its
    image has (from the lock; uv's cache makes it quick)."""
    venv = tmp_path_factory.mktemp("operator-only") / "venv"
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv), "UV_PYTHON_DOWNLOADS": "never"}
    command = [uv(), "sync", "--locked", "--package", "pdserve-operator", "--no-dev", "--quiet"]
    subprocess.run([*command, "--python", sys.executable], cwd=ROOT, env=env, check=True)
    return venv / "bin"


def test_the_operator_runs_where_torch_is_not_installed(operator_only: Path) -> None:
    python = operator_only / "python"
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0
    # The operator's modules load, and `pdserve crd` works.
    code = (
        "import pdserve.operator.main, pdserve.operator.controller.handlers, "
        "pdserve.operator.render"
    )
    subprocess.run([python, "-c", code], check=True)
    crd = subprocess.run([operator_only / "pdserve", "crd"], capture_output=True, text=True)
    assert crd.returncode == 0 and "kind: CustomResourceDefinition" in crd.stdout
    # The workers' commands are listed, and say which package they need.
    worker = subprocess.run(
        [operator_only / "pdserve", "worker", "--model", "x"], capture_output=True, text=True
    )
    assert worker.returncode == 2
    assert "needs the pdserve-workers package" in worker.stderr


def test_the_operator_entry_point_imports_no_torch() -> None:
    # In the full environment too: torch made unimportable changes nothing.
    code = (
        "import sys\n"
        "for name in ('torch', 'nixl', 'safetensors', 'tokenizers'): sys.modules[name] = None\n"
        "import pdserve.operator.main, pdserve.operator.controller.handlers\n"
        "from pdserve.cli.main import main\n"
        "sys.exit(main(['crd']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "CustomResourceDefinition" in result.stdout


def test_pdserve_processes_run_this_checkouts_code(small_model_dir: Path, tmp_path: Path) -> None:
    version = subprocess.run(
        pdserve_command("version"), capture_output=True, text=True, check=True
    ).stdout
    for part in ("base", "protocol", "cli", "operator", "workers"):
        assert str(ROOT / part / "src" / "pdserve" / part) in version
    # A worker process says where its code comes from when it starts.
    with running_worker(small_model_dir, tmp_path) as worker:
        assert f"pdserve-workers 0.1.0 from {ROOT / 'workers' / 'src'}" in worker.log()
