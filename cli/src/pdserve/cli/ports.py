"""Telling a parent process which port a server bound.

pdserve's servers accept `--port 0 --port-file PATH`: the system picks a free port at
bind time and the server writes it to PATH, so no port is chosen by one process and
bound later by another (a race that fails on a busy machine)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def announce_port(path: Path, port: int) -> None:
    """Write `port` to `path` atomically (a reader never sees a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as handle:
        handle.write(f"{port}\n")
    os.replace(handle.name, path)
