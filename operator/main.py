"""`pdserve operator`: run the ServingPool operator in this process."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Sequence
from pathlib import Path

import kopf

from pdserve.operator import metrics


class _QuietWatchHandlers(logging.Filter):
    """Drops kopf's line per watch event ("Handler 'child_event' succeeded."): one per
    event on every child would drown what matters."""

    def filter(self, record: logging.LogRecord) -> bool:
        quiet = record.levelno <= logging.INFO and record.getMessage().startswith(
            ("Handler 'child_event'", "Handler 'pool_event'")
        )
        return not quiet


def run(
    *,
    namespaces: Sequence[str] = (),
    kubeconfig: Path | None = None,
    metrics_port: int = 8080,
    metrics_host: str = "0.0.0.0",
    health_port: int = 0,
    verbose: bool = False,
) -> int:
    """Run the operator until interrupted: every namespace unless `namespaces` are given.

    /metrics is served on metrics_host:metrics_port, and kopf's liveness probe on
    metrics_host:health_port/healthz (port 0: neither).
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kopf.objects").addFilter(_QuietWatchHandlers())
    importlib.import_module("pdserve.operator.handlers")  # registers the handlers with kopf
    metrics.serve(metrics_port, metrics_host)
    liveness = f"http://{metrics_host}:{health_port}/healthz" if health_port else None
    asyncio.run(
        kopf.operator(
            registry=kopf.get_default_registry(),
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            standalone=True,  # no peering: one operator per cluster (or per namespace set)
            liveness_endpoint=liveness,
            memo=kopf.Memo(kubeconfig=kubeconfig),
        )
    )
    return 0
