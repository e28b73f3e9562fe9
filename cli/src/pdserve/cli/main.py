"""The `pdserve` command line.

Each subcommand lives in the module that owns it, in the installed part of pdserve
that owns it; that module exposes `register(subparsers)`, which adds its parser and
sets `handler` (a callable taking the parsed namespace and returning an exit code).
Registration modules import nothing heavy at module level (no torch), so
`pdserve --help` stays fast.

Inside an image only one part is installed (the operator's image has no workers);
the other part's subcommands are still listed, and running one says which package
to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.base.options import OptionError

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class CommandSource:
    """Where some subcommands are registered, and the package that provides them."""

    module: str
    package: str
    commands: tuple[str, ...]


# In the order `--help` lists them.
COMMAND_SOURCES: tuple[CommandSource, ...] = (
    CommandSource("pdserve.workers.model.checkpoint_cli", "pdserve-workers", ("model",)),
    CommandSource("pdserve.workers.server.cli", "pdserve-workers", ("worker",)),
    CommandSource("pdserve.workers.router.cli", "pdserve-workers", ("router",)),
    CommandSource("pdserve.workers.bench.cli", "pdserve-workers", ("bench",)),
    CommandSource("pdserve.workers.plan.cli", "pdserve-workers", ("profile", "simulate")),
    CommandSource("pdserve.cli.demo", "pdserve-workers", ("demo",)),
    CommandSource("pdserve.operator.cli", "pdserve-operator", ("crd", "operator", "local")),
    CommandSource("pdserve.operator.planning.cli", "pdserve-operator", ("plan",)),
    CommandSource("pdserve.base.version", "pdserve-base", ("version",)),
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every subcommand (missing parts as placeholders)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for source in COMMAND_SOURCES:
        try:
            module = importlib.import_module(source.module)
        except ModuleNotFoundError as error:
            if not _is_missing_part(error, source.module):
                raise
            _register_missing(subparsers, source)
            continue
        module.register(subparsers)
    return parser


def _is_missing_part(error: ModuleNotFoundError, module: str) -> bool:
    """Whether `module` failed because the part it belongs to is not installed (as
    opposed to a bug or a missing third-party library inside an installed part)."""
    part = ".".join(module.split(".")[:2])
    return error.name is not None and part.startswith(error.name)


def _register_missing(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], source: CommandSource
) -> None:
    for command in source.commands:
        parser = subparsers.add_parser(
            command, help=f"(needs the {source.package} package)", add_help=False
        )
        # Whatever follows is this command's business; it only says what is missing.
        parser.set_defaults(handler=_missing_handler(command, source.package), any_args=True)


def _missing_handler(command: str, package: str) -> Handler:
    def handler(_: argparse.Namespace) -> int:
        print(
            f"pdserve {command}: this command needs the {package} package, which is not "
            f"installed here (pip install {package})",
            file=sys.stderr,
        )
        return 2

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the chosen subcommand."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    handler: Handler = args.handler
    try:
        return handler(args)
    except OptionError as error:
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
