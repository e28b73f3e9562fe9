"""A real Prometheus server for tests (Debian's package, from the project's cache),
and synchronous access to what it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import aiohttp

from pdserve.operator.local.promserver import PrometheusServer
from pdserve.operator.scaling.prometheus import Prometheus
from support.tools import prometheus as prometheus_binary

T = TypeVar("T")

# Short enough for windows of a few seconds: rate() needs two samples in its window.
SCRAPE_INTERVAL_S = 0.25


@contextmanager
def running_prometheus(
    run_dir: Path,
    targets: Sequence[str] = (),
    *,
    labels: Mapping[str, str] | None = None,
    scrape_interval_s: float = SCRAPE_INTERVAL_S,
) -> Iterator[PrometheusServer]:
    """A ready Prometheus scraping `targets` (host:port) every `scrape_interval_s`."""
    server = PrometheusServer(
        run_dir, binary=prometheus_binary(), scrape_interval_s=scrape_interval_s, labels=labels
    )
    server.start(targets)
    try:
        yield server
    finally:
        server.stop()


def host_port(url: str) -> str:
    """host:port of an http:// URL."""
    return url.removeprefix("http://").rstrip("/")


def ask(url: str, call: Callable[[Prometheus], Awaitable[T]]) -> T:
    """Run one coroutine of the operator's Prometheus client against `url`."""

    async def run() -> T:
        async with aiohttp.ClientSession() as session:
            return await call(Prometheus(url, session))

    return asyncio.run(run())
