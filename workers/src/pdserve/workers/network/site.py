"""Listening with the guarded protocol: an aiohttp site whose connections are
`GuardedRequestHandler`s, for an `AppRunner` that is set up. It replaces aiohttp's
`TCPSite` in both servers."""

from __future__ import annotations

import asyncio

from aiohttp import web

from pdserve.workers.network.connection import GuardedRequestHandler
from pdserve.workers.network.guard import NetworkGuard


class GuardedSite(web.BaseSite):
    """A TCP site serving `runner`'s application through guarded connections."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: NetworkGuard) -> None:
        super().__init__(runner)
        self._guarded_runner = runner
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._guarded_runner.server
        assert server is not None, "the runner is set up first"
        loop = asyncio.get_running_loop()

        def connection() -> GuardedRequestHandler:
            return GuardedRequestHandler(server, self._guard, loop=loop, access_log=None)

        self._server = await loop.create_server(connection, self._host, self._port)

    @property
    def port(self) -> int:
        """The port bound (the one the system picked for port 0)."""
        assert self._server is not None, "the site is started first"
        sockets = self._server.sockets  # type: ignore[attr-defined]
        return int(sockets[0].getsockname()[1])


async def listen(runner: web.BaseRunner, host: str, port: int, guard: NetworkGuard) -> int:
    """Serve `runner` on host:port under `guard`; the port bound (OSError when it
    cannot be)."""
    site = GuardedSite(runner, host, port, guard)
    await site.start()
    return site.port
