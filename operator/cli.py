"""`pdserve` subcommands of the control plane."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the control-plane subcommands (`crd`)."""
    parser = subparsers.add_parser(
        "crd",
        help="print the ServingPool CustomResourceDefinition",
        description="Generate the ServingPool CRD (crds/servingpool.yaml) from the API model.",
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="write to this file instead of standard output"
    )
    parser.set_defaults(handler=_crd)


def _crd(args: argparse.Namespace) -> int:
    from pdserve.operator.crd import crd_yaml

    text = crd_yaml()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0
