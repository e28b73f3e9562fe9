"""`pdserve` subcommands of the control plane."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the control-plane subcommands (`crd`, `operator`)."""
    parser = subparsers.add_parser(
        "crd",
        help="print the ServingPool CustomResourceDefinition",
        description="Generate the ServingPool CRD (crds/servingpool.yaml) from the API model.",
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="write to this file instead of standard output"
    )
    parser.set_defaults(handler=_crd)
    _register_operator(subparsers)


def _register_operator(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the ServingPool operator",
        description="Turn ServingPools into Deployments, Services and the rest, and keep "
        "them so (kopf; server-side apply; status and Events on each pool).",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; default: all namespaces)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument(
        "--kubeconfig", type=Path, help="kubeconfig file (default: $KUBECONFIG, then in-cluster)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0: off)"
    )
    parser.add_argument(
        "--metrics-host", default="0.0.0.0", help="address /metrics and /healthz listen on"
    )
    parser.add_argument(
        "--health-port", type=int, default=0, help="liveness probe port, /healthz (0: off)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.set_defaults(handler=_operator)


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

    return run(
        namespaces=args.namespace,
        kubeconfig=args.kubeconfig,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        health_port=args.health_port,
        verbose=args.verbose,
    )
