"""Network helpers for tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def refusing_url() -> Iterator[str]:
    """An http:// URL on loopback that refuses connections for as long as the block
    runs: its port is bound (so nobody else can take it) but never listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
