"""`pdserve` subcommands of the control plane."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.base.options import add_options, options_from
from pdserve.operator.options import LocalOptions, OperatorOptions


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the control-plane subcommands (`crd`, `operator`, `local`)."""
    parser = subparsers.add_parser(
        "crd",
        help="print the ServingPool CustomResourceDefinition",
        description=(
            "Generate the ServingPool CRD (charts/pdserve/crds/servingpool.yaml) from the "
            "API model."
        ),
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="write to this file instead of standard output"
    )
    parser.set_defaults(handler=_crd)
    parser = subparsers.add_parser(
        "operator",
        help="run the ServingPool operator",
        description="Turn ServingPools into Deployments, Services and the rest, and keep "
        "them so (kopf; server-side apply; status and Events on each pool).",
    )
    add_options(parser, OperatorOptions)
    parser.set_defaults(handler=_operator)
    parser = subparsers.add_parser(
        "local",
        help="run a ServingPool as processes on this machine",
        description="Run a ServingPool's router and workers as local processes, with the "
        "command lines the operator renders for a cluster; prints the router's URL. Edits "
        "to the manifest are applied while it runs (a bad one is refused, the pool kept). "
        "Ctrl-C stops them all.",
    )
    add_options(parser, LocalOptions)
    parser.set_defaults(handler=_local)


def _crd(args: argparse.Namespace) -> int:
    from pdserve.operator.crd import crd_yaml

    text = crd_yaml()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


def _operator(args: argparse.Namespace) -> int:
    from pdserve.operator.main import run

    return run(options_from(args, OperatorOptions))


def _local(args: argparse.Namespace) -> int:
    from pdserve.operator.local.main import Monitoring, serve

    options = options_from(args, LocalOptions)
    monitoring = Monitoring(options.prometheus, options.scrape_interval, options.prometheus_url)
    return serve(
        options.file, options.model_dir, options.host, options.port, options.port_file,
        options.run_dir, options.api_key_file, monitoring,
    )  # fmt: skip
