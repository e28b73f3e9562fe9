"""The layer contracts `make lint` checks (pyproject.toml, [tool.importlinter]) hold on
this tree, and fail when a forbidden import is added: checked on a copy of the sources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("base", "protocol", "cli", "operator", "workers")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The workspace's sources and pyproject.toml, copied."""
    for part in PARTS:
        shutil.copytree(ROOT / part / "src", tmp_path / part / "src")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` as `make lint` runs it, on the copy's sources."""
    path = os.pathsep.join(str(tree / part / "src") for part in PARTS)
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip


def add_import(module: Path, statement: str) -> None:
    text = module.read_text()
    marker = "from __future__ import annotations\n"
    module.write_text(text.replace(marker, f"{marker}\n{statement}\n", 1))


def test_the_contracts_hold(tree: Path) -> None:
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "statement", "contract"),
    [
        (
            "workers/src/pdserve/workers/router/sse.py",
            "import pdserve.workers.server.app",
            "router never imports server or bench",
        ),
        (
            "workers/src/pdserve/workers/engine/scheduler.py",
            "import pdserve.workers.handoff.errors",
            "engine below handoff below server",
        ),
        (
            "protocol/src/pdserve/protocol/headers.py",
            "import pdserve.workers.engine.scheduler",
            "protocol imports nothing of pdserve but base",
        ),
        (
            "base/src/pdserve/base/ports.py",
            "import pdserve.protocol.headers",
            "base imports nothing of pdserve",
        ),
        (
            "operator/src/pdserve/operator/render.py",
            "import pdserve.workers.engine.config",
            "operator and workers are independent",
        ),
        (
            "operator/src/pdserve/operator/controller/handlers.py",
            "import pdserve.operator.cli",
            "operator: cli above main above the handlers above options",
        ),
        (
            "operator/src/pdserve/operator/local/pool.py",
            "import pdserve.operator.local.rollout",
            "local pool: main above rollout above pool",
        ),
        (
            "workers/src/pdserve/workers/network/guard.py",
            "import pdserve.workers.network.bodies",
            "network: the servers above bodies above connection above guard",
        ),
        (
            "workers/src/pdserve/workers/router/discovery.py",
            "import pdserve.workers.router.kubernetes",
            "router: app above kubernetes above discovery",
        ),
        (
            "workers/src/pdserve/workers/engine/step_cost.py",
            "import pdserve.workers.engine.scheduler",
            "engine: the scheduler above its budget above the step-cost model",
        ),
        (
            "workers/src/pdserve/workers/router/outcome.py",
            "import pdserve.workers.router.proxy",
            "router: the forwarder above the outcome above the routed request",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tree: Path, module: str, statement: str, contract: str
) -> None:
    add_import(tree / module, statement)
    result = lint_imports(tree)
    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), result.stdout
