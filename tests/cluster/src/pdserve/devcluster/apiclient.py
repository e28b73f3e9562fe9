"""Minimal HTTPS reads from the API server, for readiness polling.

Polling through kubectl would start a process per probe; this is a plain GET with
the admin client certificate.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.devcluster.certs import KeyPair


class ApiReader:
    """GETs paths on one API server with a client certificate."""

    def __init__(self, server: str, ca_cert: Path, client: KeyPair, timeout: float = 5.0) -> None:
        self.server = server
        self.timeout = timeout
        self._context = ssl.create_default_context(cafile=str(ca_cert))
        self._context.load_cert_chain(str(client.cert), str(client.key))

    def get(self, path: str) -> tuple[int, str]:
        """Status code and body of GET `path`; status 0 when nothing answered."""
        try:
            with urllib.request.urlopen(
                self.server + path, timeout=self.timeout, context=self._context
            ) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as error:
            return int(error.code), error.read().decode(errors="replace")
        except (OSError, ssl.SSLError):
            return 0, ""

    def get_json(self, path: str) -> dict[str, Any] | None:
        """The decoded object at `path`, or None when it is not there (yet)."""
        status, body = self.get(path)
        if status != 200:
            return None
        result: dict[str, Any] = json.loads(body)
        return result

    def ready(self) -> bool:
        """Whether /readyz passes (storage, RBAC bootstrap and the other post-start hooks)."""
        return self.get("/readyz")[0] == 200


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a plain-HTTP GET of `url` answers 200 (etcd's /health)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status) == 200
    except OSError:
        return False
