"""The settings of `pdserve router`, each declared once (see `pdserve.base.options`);
the request limits are the worker's (`RequestLimits`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.base.options import option, port_number, positive_int
from pdserve.protocol.limits import LIMITS

_POOL = "the pool"


@dataclass(frozen=True)
class RouterOptions:
    """The settings of `pdserve router`."""

    config: Path = option(
        parse=Path, metavar="PATH",
        help="routing.json: buckets, model, discovery (re-read when it changes)",
    )  # fmt: skip
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, parse=port_number, help="port to listen on (0: any free port)")
    port_file: Path | None = option(
        None, parse=Path, metavar="PATH",
        help="once listening, write the port here (for --port 0)",
    )  # fmt: skip
    internal_token_file: Path | None = option(
        None, parse=Path, metavar="PATH", group=_POOL,
        help="file holding the pool's internal credential, presented to the workers "
        "(without it, workers refuse hand-offs and every request is served colocated)",
    )  # fmt: skip
    kubeconfig: Path | None = option(
        None, parse=Path, metavar="PATH", group=_POOL,
        help="Kubernetes discovery: kubeconfig (default: $KUBECONFIG, then the pod's "
        "ServiceAccount)",
    )  # fmt: skip
    api_key_file: Path | None = option(
        None, parse=Path, metavar="PATH", group=_POOL,
        help="require clients to present one of the keys in this file (one per line) "
        "as `Authorization: Bearer KEY`",
    )  # fmt: skip
    max_attempts: int = option(
        3, parse=positive_int, group=_POOL,
        help="workers tried per request before the first token reaches the client",
    )  # fmt: skip
    max_queued_requests: int = option(
        4096, parse=positive_int, group=LIMITS,
        help="requests waiting for their first token; past this, new ones get 429",
    )  # fmt: skip
    log_level: str = option("info", choices=("debug", "info", "warning", "error"), help="log level")
