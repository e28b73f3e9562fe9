"""Compiled builds (mypyc) of pdserve-workers' hot modules: `built()` says which, and
from which sources; `pdserve.workers.compiled` decides whether they are used."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def built() -> dict[str, str]:
    """The compiled modules (paths under pdserve/workers/, e.g. `router/sse.py`) and
    the SHA-256 of the source each was compiled from; empty when nothing was compiled."""
    try:
        record = json.loads((HERE / "built.json").read_text())
    except FileNotFoundError:
        return {}
    sources: dict[str, str] = record["sources"]
    return sources
