"""`pdserve version`: which parts of pdserve are installed, their versions and where
their code is loaded from (a checkout, for an editable install)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
from pathlib import Path

# Distribution -> the package it provides.
PARTS: dict[str, str] = {
    "pdserve": "pdserve.cli",
    "pdserve-base": "pdserve.base",
    "pdserve-protocol": "pdserve.protocol",
    "pdserve-operator": "pdserve.operator",
    "pdserve-workers": "pdserve.workers",
    # The router's hot modules compiled (where a C compiler was); the router's start-up
    # log says whether they run or why the Python does.
    "pdserve-native": "pdserve.native",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pdserve version`."""
    parser = subparsers.add_parser("version", help="show the installed parts and their versions")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.set_defaults(handler=run)


def installed_parts() -> dict[str, dict[str, str]]:
    """Each installed part: its version and the folder its package is loaded from."""
    parts = {}
    for distribution, package in PARTS.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        location = str(Path(next(iter(spec.submodule_search_locations))).resolve())
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        parts[distribution] = {"version": version, "path": location}
    return parts


def run(args: argparse.Namespace) -> int:
    """Print the installed parts."""
    parts = installed_parts()
    if args.json:
        print(json.dumps(parts, indent=2))
        return 0
    for distribution, part in parts.items():
        print(f"{distribution} {part['version']}  {part['path']}")
    return 0
