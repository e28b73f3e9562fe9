"""`pdserve worker`: start one worker on a model directory."""

from __future__ import annotations

import argparse

from pdserve.base.options import add_options, options_from
from pdserve.protocol.limits import RequestLimits
from pdserve.workers.network.limits import NetworkLimits
from pdserve.workers.server.options import WorkerOptions


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pdserve worker`."""
    parser = subparsers.add_parser(
        "worker",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API, alone (role both) "
        "or as one side of prefill/decode disaggregation.",
    )
    add_options(parser, WorkerOptions)
    add_options(parser, RequestLimits)
    add_options(parser, NetworkLimits)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Start the worker and serve until interrupted."""
    from pdserve.workers.server.worker import serve

    return serve(
        options_from(args, WorkerOptions),
        options_from(args, RequestLimits),
        options_from(args, NetworkLimits),
    )
