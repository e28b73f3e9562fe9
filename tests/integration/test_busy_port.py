"""A port another process holds is a configuration error: `pdserve worker`,
`pdserve router` and `pdserve local` say so in one line naming the port and the flag
that changes it, and exit with status 2 (as for other configuration errors), before
they load a model or start a worker."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdserve.base.process import pdserve_command
from pdserve.operator import api
from support.router import pool_manifest


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on loopback another process listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield holder.getsockname()[1]


def arguments(command: str, model_dir: Path, folder: Path) -> list[str]:
    """A configuration that would start (but for the port)."""
    if command == "worker":
        return ["--model", str(model_dir)]
    if command == "router":
        table = {
            "pool": "p",
            "model": {"name": "small", "path": str(model_dir)},
            "buckets": [{"mode": "colocated"}],
            "discovery": {"kind": "static", "decode": ["http://127.0.0.1:1"]},
        }
        routing = folder / "routing.json"
        routing.write_text(json.dumps(table))
        return ["--config", str(routing)]
    manifest = folder / "pool.yaml"
    manifest.write_text(yaml.safe_dump(api.dump(pool_manifest("busy", model_dir))))
    return ["-f", str(manifest), "--run-dir", str(folder / "run")]


@pytest.mark.parametrize("command", ["worker", "router", "local"])
def test_a_busy_port_is_one_line_and_status_2(
    command: str, busy_port: int, small_model_dir: Path, tmp_path: Path
) -> None:
    argv = [*arguments(command, small_model_dir, tmp_path), "--host", "127.0.0.1"]
    started = subprocess.run(
        pdserve_command(command, *argv, "--port", str(busy_port)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = f"port {busy_port} on 127.0.0.1 is already in use: choose another with --port"
    assert (started.returncode, started.stderr) == (2, f"pdserve {command}: {said}\n")
    assert not (tmp_path / "run" / "logs").exists()  # no worker was started
