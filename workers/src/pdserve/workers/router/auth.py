"""Client API keys: when the router is given `--api-key-file`, every `/v1/*` request
(and the tokenizer's endpoints, and `/workers`) must present one of its keys
(`Authorization: Bearer KEY`), else it gets OpenAI's 401. The file holds one key per
line (blank lines and `#` comments ignored) and is re-read when it changes, so keys
mounted from a Secret can be rotated without a restart. The file says which keys are
valid, whenever it is read: one that holds none (emptied), or that cannot be read
any more, leaves no key valid; it never leaves old keys in force."""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.protocol.api_errors import APIError, ClientRequest
from pdserve.protocol.internal import CLIENT_PREFIXES, presented_token

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
# The paths that need a key: the OpenAI API, the tokenizer's endpoints (they cost the
# router CPU as completions do; vLLM leaves them open) and /workers (it names the
# workers' internal addresses). The probes and /metrics stay open, as in vLLM, for
# the kubelet and Prometheus; /metrics names no worker.
PROTECTED_PREFIXES = (*CLIENT_PREFIXES, "/workers")


class ApiKeyError(ValueError):
    """A key file that cannot be used."""


def read_keys(path: Path) -> tuple[str, ...]:
    """The keys in `path` (none when it holds none); ApiKeyError when it cannot be read."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ApiKeyError(f"cannot read API keys from {path}: {error.strerror}") from error
    return tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))


class ApiKeys:
    """The keys clients must present (no file: no check; a file without keys: every
    request is refused)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._keys = read_keys(path) if path is not None else ()
        if path is not None and not self._keys:
            log.warning("%s holds no API key: every request needing one is refused", path)
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            stat = self.path.stat() if self.path is not None else None
        except OSError:
            return None
        return None if stat is None else (stat.st_mtime_ns, stat.st_size)

    def _refresh(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < CHECK_INTERVAL_S:
            return
        self._checked = now
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._keys = read_keys(self.path)
        except ApiKeyError as error:
            self._keys = ()
            log.error("%s; no key is valid until it can be read", error)
            return
        if self._keys:
            log.info("API keys re-read from %s", self.path)
        else:
            log.warning(
                "%s holds no API key any more: every request needing one is refused", self.path
            )

    def check(self, request: ClientRequest) -> None:
        """OpenAI's 401 unless the request presents a key (when keys are required)."""
        if self.path is None:
            return
        self._refresh()
        token = presented_token(request)
        if token is None:
            raise _unauthorized(
                "You didn't provide an API key. Send it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY)."
            )
        if not any(hmac.compare_digest(token.encode(), key.encode()) for key in self._keys):
            raise _unauthorized("Incorrect API key provided.")

    def middleware(self) -> Middleware:
        """Checks keys on the OpenAI and tokenizer endpoints and /workers (probes and
        /metrics stay open)."""

        @web.middleware
        async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path.startswith(PROTECTED_PREFIXES):
                self.check(request)
            return await handler(request)

        return require_key


def _unauthorized(message: str) -> APIError:
    return APIError(
        401, message, "invalid_request_error", "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )  # fmt: skip
