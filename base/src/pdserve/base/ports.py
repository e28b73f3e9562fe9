"""Telling a parent process which port a server bound.

pdserve's servers accept `--port 0 --port-file PATH`: the system picks a free port at
bind time and the server writes it to PATH, so no port is chosen by one process and
bound later by another (a race that fails on a busy machine). A port given that another
process holds is a configuration error, said in one line naming the flag."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path


def announce_port(path: Path, port: int) -> None:
    """Write `port` to `path` atomically (a reader never sees a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as handle:
        handle.write(f"{port}\n")
    os.replace(handle.name, path)


class PortInUseError(OSError):
    """A server's port is taken by another process (a configuration error: the
    message names the port and the flag that changes it)."""

    def __init__(self, host: str, port: int, flag: str = "--port") -> None:
        message = f"port {port} on {host} is already in use: choose another with {flag}"
        super().__init__(errno.EADDRINUSE, message)

    def __str__(self) -> str:
        return str(self.strerror)


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Raise PortInUseError when `port` cannot be bound on `host` now (as a server
    binds it: every address of the host, reusing a port in TIME_WAIT), so a server can
    say so before it loads anything. Port 0 always can; other failures (an address
    that does not resolve or is not this machine's) are left for the server's own
    bind to report."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PortInUseError(host, port, flag) from error


@contextlib.contextmanager
def binding(host: str, port: int, flag: str = "--port") -> Iterator[None]:
    """Turn the system's "address already in use", raised in the block, into
    PortInUseError."""
    try:
        yield
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(host, port, flag) from error
