"""Finding the pool's workers: a static list (the local pool, `StaticSource`), or the
EndpointSlices of the pool's prefill and decode Services in Kubernetes, watched
(`kubernetes`, which builds on this module's interface; `app` picks the source the
routing table names). A source reports each role's current list of ready workers'
URLs; `synced` is set once it has reported at least once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from pdserve.protocol.routing import Role, StaticDiscovery

# Called with a role and the full list of its ready workers' base URLs.
Report = Callable[[Role, list[str]], None]


class DiscoverySource(Protocol):
    """Reports the pool's workers until cancelled."""

    synced: asyncio.Event

    async def run(self, report: Report) -> None:
        """Report the workers, and again whenever they change."""


class StaticSource:
    """Workers at fixed URLs."""

    def __init__(self, config: StaticDiscovery) -> None:
        self.config = config
        self.synced = asyncio.Event()

    async def run(self, report: Report) -> None:
        """Report the lists once; they do not change."""
        report("decode", list(self.config.decode))
        report("prefill", list(self.config.prefill))
        self.synced.set()
        await asyncio.Event().wait()
