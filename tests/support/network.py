"""Network helpers for tests."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from aiohttp import web


@contextmanager
def refusing_url() -> Iterator[str]:
    """An http:// URL on loopback that refuses connections for as long as the block
    runs: its port is bound (so nobody else can take it) but never listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def free_port() -> int:
    """A loopback port free now, for servers that cannot be told port 0 (a peer's
    binary); another process may take it before they bind, which a benchmark risks."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """The http:// URL of `app` served on loopback, on a port the system picks at
    bind, for as long as the block runs."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class Witness:
    """A listening socket that nobody should connect to: it records every attempt."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def connections(self) -> int:
        """Connection attempts so far (taken off the backlog as they are counted)."""
        count = 0
        self._sock.setblocking(False)
        while True:
            try:
                peer, _ = self._sock.accept()
            except BlockingIOError:
                return count
            peer.close()
            count += 1


@contextmanager
def witness() -> Iterator[Witness]:
    """A Witness on loopback for as long as the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield Witness(sock)
