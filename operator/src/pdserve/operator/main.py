"""`pdserve operator`: run the ServingPool operator in this process."""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys

import kopf
from aiohttp import web

from pdserve.base.ports import announce_port
from pdserve.operator import metrics
from pdserve.operator.controller.kube import ConfigError, Credentials, load_credentials
from pdserve.operator.identity import own_identity
from pdserve.operator.options import OperatorOptions


class _QuietWatchHandlers(logging.Filter):
    """Drops kopf's line per watch event ("Handler 'child_event' succeeded."): one per
    event on every child would drown what matters."""

    def filter(self, record: logging.LogRecord) -> bool:
        quiet = record.levelno <= logging.INFO and record.getMessage().startswith(
            ("Handler 'child_event'", "Handler 'pool_event'")
        )
        return not quiet


def run(options: OperatorOptions) -> int:
    """Run the operator until interrupted: every namespace unless some are given.

    /metrics, /healthz and /readyz are served on metrics_host:metrics_port. Without a
    usable cluster configuration it returns 2 at once, saying what to fix (kopf would
    retry its start-up forever).
    """
    try:
        credentials = load_credentials(options.kubeconfig)
    except ConfigError as error:
        print(f"pdserve operator: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if options.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kopf.objects").addFilter(_QuietWatchHandlers())
    importlib.import_module(
        "pdserve.operator.controller.handlers"
    )  # registers the handlers with kopf
    asyncio.run(_operate(options, credentials))
    return 0


async def _operate(options: OperatorOptions, credentials: Credentials) -> None:
    runner = web.AppRunner(metrics.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, options.metrics_host, options.metrics_port).start()
    if options.port_file is not None:
        announce_port(options.port_file, int(runner.addresses[0][1]))
    try:
        await kopf.operator(
            registry=kopf.get_default_registry(),
            clusterwide=not options.namespace,
            namespaces=list(options.namespace),
            standalone=True,  # no peering: one operator per cluster (or per namespace set)
            identity=own_identity(),  # type: ignore[arg-type]  # kopf's NewType of str
            memo=kopf.Memo(options=options, credentials=credentials),
        )
    finally:
        await runner.cleanup()
