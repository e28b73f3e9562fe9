"""`pdserve router`: the pool's OpenAI-compatible front door."""

from __future__ import annotations

import argparse

from pdserve.base.options import add_options, options_from
from pdserve.protocol.limits import RequestLimits
from pdserve.workers.network.limits import NetworkLimits
from pdserve.workers.router.options import RouterOptions


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `pdserve router`."""
    parser = subparsers.add_parser(
        "router",
        help="route OpenAI requests to a pool's workers by prompt length",
        description="The pool's OpenAI-compatible front door: each request is served "
        "colocated (a decode worker prefills it) or disaggregated (a prefill worker, then a "
        "decode worker) by its prompt's length bucket, on the least loaded workers.",
    )
    add_options(parser, RouterOptions)
    add_options(parser, RequestLimits)
    add_options(parser, NetworkLimits)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Start the router and serve until interrupted."""
    from pdserve.workers.router.main import serve

    return serve(
        options_from(args, RouterOptions),
        options_from(args, RequestLimits),
        options_from(args, NetworkLimits),
    )
