"""The pool's trusted internal path: the credential the router and the workers share,
and the prefill workers a decode worker may be sent to.

A worker honours `X-Pdserve-Prefill-Url` and serves `/pd/*` only for callers that
present the pool's credential (`Authorization: Bearer <credential>`; a Secret in
Kubernetes, a file made per run by the local pool, see `pdserve.base.credentials`),
and takes a prefill URL only when it names one of the pool's prefill workers
(`--prefill-peer`). So no client can make a worker connect to an address of its
choosing, nor write KV blocks into it.

A worker that has the credential serves its client endpoints (the OpenAI API and the
tokenizer's) to holders only, the pool's router, unless it is started with
`--allow-direct-clients`: the router's API keys and limits cannot be bypassed by
calling a worker. A worker without a credential (one alone, not in a pool) serves
them to anyone.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.protocol.api_errors import APIError, ClientRequest

log = logging.getLogger(__name__)

MIN_CREDENTIAL_LENGTH = 16
INTERNAL_PREFIX = "/pd/"
# What clients call: the OpenAI endpoints and the tokenizer's (the router asks client
# API keys on the same paths).
CLIENT_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# How long a resolved peer name is trusted before it is looked up again.
RESOLVE_INTERVAL_S = 1.0


class CredentialError(ValueError):
    """A credential file that cannot be used."""


def read_credential(path: Path) -> str:
    """The credential held in `path` (surrounding whitespace ignored)."""
    try:
        credential = path.read_text().strip()
    except OSError as error:
        raise CredentialError(f"cannot read the internal credential {path}: {error}") from error
    if len(credential) < MIN_CREDENTIAL_LENGTH or any(c.isspace() for c in credential):
        raise CredentialError(
            f"{path}: the internal credential must be one word of at least "
            f"{MIN_CREDENTIAL_LENGTH} characters"
        )
    return credential


def bearer(credential: str) -> dict[str, str]:
    """The header that presents `credential`."""
    return {"Authorization": f"Bearer {credential}"}


def presented_token(request: ClientRequest) -> str | None:
    """The bearer token of a request, if it has one."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class InternalAuth:
    """Checks the pool's credential on internal calls, and on clients' calls unless
    `allow_direct_clients` (or there is no credential to check)."""

    def __init__(self, credential: str | None, *, allow_direct_clients: bool = False) -> None:
        self.credential = credential
        self.guards_clients = credential is not None and not allow_direct_clients

    def holds(self, request: web.Request) -> bool:
        """Whether the caller presented the pool's credential."""
        token = presented_token(request)
        if self.credential is None or token is None:
            return False
        return hmac.compare_digest(token.encode(), self.credential.encode())

    def require(self, request: web.Request, what: str) -> None:
        """Refuse (401, or 403 on a worker without a credential) unless the caller
        holds the credential; `what` names what needs it."""
        if self.credential is None:
            raise APIError(
                403, f"{what} is refused: this worker has no internal credential "
                "(--internal-token-file)", "invalid_request_error", "forbidden",
            )  # fmt: skip
        if not self.holds(request):
            raise APIError(
                401, f"{what} needs the pool's internal credential", "invalid_request_error",
                "invalid_credential", headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    def middleware(self) -> Middleware:
        """Guards the internal endpoints (/pd/*) and, unless direct clients are
        allowed, the client endpoints."""

        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path.startswith(INTERNAL_PREFIX):
                self.require(request, f"{request.path}")
            elif self.guards_clients and request.path.startswith(CLIENT_PREFIXES):
                self.require(request, f"{request.path} (served to the pool's router only)")
            return await handler(request)

        return guard


@dataclass(frozen=True)
class WorkerAddress:
    """Where a worker listens: scheme, host (a name or an IP address) and port."""

    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        """The base URL (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_worker_url(url: str) -> WorkerAddress:
    """A worker's base URL, strictly: http(s), a host, no user, path, query or
    fragment. Raises ValueError naming the problem."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as error:
        raise ValueError(f"not a worker URL: {url!r} ({error})") from error
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a worker URL: {url!r} (expected http://HOST:PORT)")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"not a worker URL: {url!r} (user, query or fragment given)")
    if parts.path not in ("", "/"):
        raise ValueError(f"not a worker URL: {url!r} (a path is given)")
    default = 443 if parts.scheme == "https" else 80
    return WorkerAddress(parts.scheme, parts.hostname.lower(), port or default)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class PrefillAllowList:
    """The prefill workers a decode worker may be sent to (`--prefill-peer`, and the
    URLs listed in `--prefill-peers-file`, one per line, re-read when a URL is not
    found, at most once a second: a local pool writes it once its prefill workers
    have bound their ports).

    A peer is a URL whose host is an address (a local pool) or a name that resolves to
    the workers' addresses (in Kubernetes, the headless Service of the pool's prefill
    workers, which lists its ready pods). A named prefill URL is accepted when its
    scheme and port are a peer's and its host is that peer's host or one of the
    addresses the peer's name resolved to (looked up again, at most once a second,
    when an address is not known yet).
    """

    def __init__(self, peers: Sequence[str], peers_file: Path | None = None) -> None:
        self.given = [parse_worker_url(peer) for peer in peers]
        self.peers_file = peers_file
        self._listed: list[WorkerAddress] = []
        self._listed_at = -RESOLVE_INTERVAL_S
        self._resolved: dict[WorkerAddress, tuple[float, frozenset[str]]] = {}

    @property
    def peers(self) -> list[WorkerAddress]:
        """The peers given and listed."""
        return self.given + self._listed

    async def admit(self, url: str) -> str:
        """The prefill worker's base URL, or a 403 when it is not one of the pool's."""
        try:
            wanted = parse_worker_url(url)
        except ValueError as error:
            raise _not_a_peer(str(error)) from error
        try:
            return await self._match(wanted)
        except APIError:
            if not self._reread():
                raise
        return await self._match(wanted)

    def _reread(self) -> bool:
        """Read the peers file again (if due); whether its list changed."""
        now = time.monotonic()
        if self.peers_file is None or now - self._listed_at < RESOLVE_INTERVAL_S:
            return False
        self._listed_at = now
        try:
            lines = self.peers_file.read_text().split()
            listed = [parse_worker_url(line) for line in lines]
        except (OSError, ValueError) as error:
            log.warning("cannot read prefill peers from %s: %s", self.peers_file, error)
            return False
        changed = listed != self._listed
        self._listed = listed
        return changed

    async def _match(self, wanted: WorkerAddress) -> str:
        candidates = [p for p in self.peers if (p.scheme, p.port) == (wanted.scheme, wanted.port)]
        if any(peer.host == wanted.host for peer in candidates):
            return wanted.url
        if _is_ip(wanted.host):
            for peer in candidates:
                if not _is_ip(peer.host) and wanted.host in await self._addresses(peer):
                    return wanted.url
        raise _not_a_peer(f"{wanted.url} is not one of this pool's prefill workers")

    async def _addresses(self, peer: WorkerAddress) -> frozenset[str]:
        now = time.monotonic()
        cached = self._resolved.get(peer)
        if cached is not None and now - cached[0] < RESOLVE_INTERVAL_S:
            return cached[1]
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
            addresses = frozenset(str(info[4][0]) for info in infos)
        except OSError as error:
            log.warning("cannot resolve prefill peer %s: %s", peer.host, error)
            addresses = frozenset()
        self._resolved[peer] = (now, addresses)
        return addresses


def _not_a_peer(message: str) -> APIError:
    return APIError(403, f"refused prefill worker: {message}", "invalid_request_error", "forbidden")
