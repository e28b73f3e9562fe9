"""The network limits of a server (`pdserve worker` and `pdserve router` alike),
each a flag with its default; uvicorn's names where it has the setting."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.base.options import option, positive_float, positive_int

NETWORK = "network limits (slow, idle and hostile clients)"


@dataclass(frozen=True)
class NetworkLimits:
    """Deadlines and caps on clients' connections (flags of the worker and the router)."""

    timeout_keep_alive: float = option(
        75.0, parse=positive_float, metavar="SECONDS", group=NETWORK,
        help="a connection with no request under way is closed after this long (longer "
        "than the idle time of the clients' connection pools: the router's is 15 s, a "
        "cloud load balancer's 60 s, so they close first)",
    )  # fmt: skip
    timeout_request_headers: float = option(
        10.0, parse=positive_float, metavar="SECONDS", group=NETWORK,
        help="a request whose headers have not all arrived this long after its first byte "
        "is cut off: its connection is closed",
    )  # fmt: skip
    timeout_request_body: float = option(
        30.0, parse=positive_float, metavar="SECONDS", group=NETWORK,
        help="a request body that has not all arrived this long after its headers gets "
        "408 and its connection is closed",
    )  # fmt: skip
    timeout_write: float = option(
        30.0, parse=positive_float, metavar="SECONDS", group=NETWORK,
        help="a client that takes none of its answer for this long (its connection's "
        "buffers full) is cut off; the request it was streaming is aborted and its KV "
        "cache freed",
    )  # fmt: skip
    limit_concurrency: int = option(
        4096, parse=positive_int, metavar="N", group=NETWORK,
        help="open connections; a request on a connection beyond them gets 503 with "
        "Retry-After and its connection is closed",
    )  # fmt: skip
    limit_body_reads: int = option(
        32, parse=positive_int, metavar="N", group=NETWORK,
        help="request bodies being received at once (the memory they may hold is N x "
        "--max-body-size); a request beyond them gets 503 with Retry-After",
    )  # fmt: skip
