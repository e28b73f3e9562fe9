"""The `pdserve` command line.

Each subcommand lives in the module that owns it; that module exposes
`register(subparsers)`, which adds its parser and sets `handler` (a callable taking
the parsed namespace and returning an exit code). Registration modules import
nothing heavy at module level (no torch), so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# Subcommand modules, in the order `--help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "pdserve.workers.engine.checkpoint_cli",
    "pdserve.workers.server_cli",
    "pdserve.workers.bench.cli",
    "pdserve.demo",
    "pdserve.operator.cli",
)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
