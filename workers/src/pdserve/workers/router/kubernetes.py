"""Discovery in Kubernetes: the EndpointSlices of the pool's prefill and decode
Services, listed and then watched (the API server's plain watch, over aiohttp), so
that workers scaled up or down, or turning ready or not, are seen within seconds.
Only ready endpoints get traffic, and only slices the EndpointSlice controller made
from the Service's selector (its managed-by label): the router sends the pool's
credential to these addresses, so a slice made by hand must not add any.

Credentials come from a kubeconfig (`--kubeconfig`, else `$KUBECONFIG`) or, inside a
pod, from its ServiceAccount (the token is re-read, since Kubernetes rotates it).
Client certificates and bearer tokens are supported; exec and auth-provider plugins
are not (a clear error says so).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from pdserve.protocol.internal import WorkerAddress
from pdserve.protocol.routing import KubernetesDiscovery, Role
from pdserve.workers.router.discovery import Report

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"  # kube-controller-manager's
IN_CLUSTER = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_SECONDS = 240
MAX_BACKOFF_S = 10.0


class KubeConfigError(ValueError):
    """Credentials that cannot be used to reach the API server."""


class KubeApiError(RuntimeError):
    """The API server refused a request."""


@dataclass(frozen=True)
class KubeAccess:
    """Where the API server is and how to authenticate to it."""

    server: str
    ssl_context: ssl.SSLContext | bool
    token: str | None = None
    token_file: Path | None = None

    def headers(self) -> dict[str, str]:
        """The authentication header (a token file is read each time: it rotates)."""
        token = self.token
        if self.token_file is not None:
            token = self.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}


def load_access(kubeconfig: Path | None = None) -> KubeAccess:
    """Credentials from `kubeconfig`, else $KUBECONFIG, else the pod's ServiceAccount."""
    path = kubeconfig
    if path is None and os.environ.get("KUBECONFIG"):
        path = Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    if path is not None:
        return _from_kubeconfig(path)
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    if host and port and (IN_CLUSTER / "token").is_file():
        context = ssl.create_default_context(cafile=str(IN_CLUSTER / "ca.crt"))
        address = WorkerAddress("https", host, int(port))
        return KubeAccess(address.url, context, token_file=IN_CLUSTER / "token")
    raise KubeConfigError(
        "Kubernetes discovery needs credentials: --kubeconfig, $KUBECONFIG, or a pod's "
        "ServiceAccount"
    )


def _from_kubeconfig(path: Path) -> KubeAccess:
    try:
        config = yaml.safe_load(path.read_text())
        context = _named(config, "contexts", config["current-context"])["context"]
        cluster = _named(config, "clusters", context["cluster"])["cluster"]
        user = _named(config, "users", context["user"]).get("user") or {}
    except (OSError, yaml.YAMLError, KeyError, TypeError) as error:
        raise KubeConfigError(f"cannot use kubeconfig {path}: {error!r}") from error
    if "exec" in user or "auth-provider" in user:
        raise KubeConfigError(f"{path}: exec and auth-provider credentials are not supported")
    base = path.parent
    token_file = user.get("tokenFile")
    try:
        context = _ssl_context(cluster, user, base)
    except (ssl.SSLError, OSError, ValueError) as error:
        raise KubeConfigError(f"{path}: unusable certificates: {error}") from error
    return KubeAccess(
        server=str(cluster["server"]).rstrip("/"),
        ssl_context=context,
        token=user.get("token"),
        token_file=base / token_file if token_file else None,
    )


def _named(config: Mapping[str, Any], section: str, name: str) -> Mapping[str, Any]:
    for entry in config.get(section) or []:
        if entry.get("name") == name:
            found: Mapping[str, Any] = entry
            return found
    raise KeyError(f"no {section[:-1]} named {name!r}")


def _ssl_context(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path) -> Any:
    if not str(cluster["server"]).startswith("https"):
        return False
    if cluster.get("insecure-skip-tls-verify"):
        return False
    context = ssl.create_default_context()
    if "certificate-authority-data" in cluster:
        context.load_verify_locations(cadata=_decoded(cluster["certificate-authority-data"]))
    elif "certificate-authority" in cluster:
        context.load_verify_locations(cafile=str(base / cluster["certificate-authority"]))
    if "client-certificate-data" in user or "client-certificate" in user:
        _load_client_certificate(context, user, base)
    return context


def _load_client_certificate(context: ssl.SSLContext, user: Mapping[str, Any], base: Path) -> None:
    # ssl reads certificate chains from files only: embedded ones go through a private
    # temporary folder, removed at once.
    with tempfile.TemporaryDirectory(prefix="pdserve-kube-") as folder:
        files = []
        for kind in ("client-certificate", "client-key"):
            if f"{kind}-data" in user:
                file = Path(folder) / kind
                file.write_text(_decoded(user[f"{kind}-data"]))
                files.append(str(file))
            else:
                files.append(str(base / user[kind]))
        context.load_cert_chain(files[0], files[1])


def _decoded(data: str) -> str:
    return base64.b64decode(data).decode("ascii")


def ready_urls(endpoint_slice: Mapping[str, Any], default_port: int) -> frozenset[str]:
    """The base URLs of a slice's ready endpoints (an unset `ready` means ready)."""
    ports = endpoint_slice.get("ports") or []
    port = next((p["port"] for p in ports if p.get("name") == "http" and p.get("port")), None)
    urls = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating"):
            continue
        addresses = endpoint.get("addresses") or []
        if addresses:
            urls.add(WorkerAddress("http", addresses[0], port or default_port).url)
    return frozenset(urls)


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


class EndpointSliceSource:
    """Watches the EndpointSlices of the pool's Services."""

    def __init__(self, access: KubeAccess, config: KubernetesDiscovery) -> None:
        self.access = access
        self.config = config
        self.synced = asyncio.Event()
        self.roles: dict[str, Role] = {config.services.decode: "decode"}
        if config.services.prefill is not None:
            self.roles[config.services.prefill] = "prefill"
        self._slices: dict[str, tuple[Role, frozenset[str]]] = {}
        self._reported: dict[Role, list[str]] = {}

    @property
    def _collection(self) -> str:
        namespace = self.config.namespace
        return (
            f"{self.access.server}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        )

    @property
    def _selector(self) -> str:
        services = ",".join(sorted(self.roles))
        return f"{SERVICE_NAME_LABEL} in ({services}),{MANAGED_BY_LABEL}={SLICE_CONTROLLER}"

    async def run(self, report: Report) -> None:
        """List, then watch; list again when the watch expires or fails."""
        connector = aiohttp.TCPConnector(ssl=self.access.ssl_context)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_SECONDS + 30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            backoff = 0.5
            while True:
                try:
                    version = await self._list(session, report)
                    backoff = 0.5
                    await self._watch(session, version, report)
                except _Expired:
                    continue
                except (aiohttp.ClientError, TimeoutError, KubeApiError, ValueError) as error:
                    log.warning(
                        "EndpointSlice watch failed (%s); retrying in %.1fs", error, backoff
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _list(self, session: aiohttp.ClientSession, report: Report) -> str:
        params = {"labelSelector": self._selector}
        headers = self.access.headers()
        async with session.get(self._collection, params=params, headers=headers) as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                raise KubeApiError(f"listing EndpointSlices: {_message(response.status, body)}")
        self._slices = {}
        for item in body.get("items") or []:
            self._store(item)
        self._report(report)
        self.synced.set()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, session: aiohttp.ClientSession, version: str, report: Report) -> None:
        params = {
            "labelSelector": self._selector,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        headers = self.access.headers()
        async with session.get(self._collection, params=params, headers=headers) as response:
            if response.status != 200:
                body = await response.json(content_type=None)
                if response.status == 410:
                    raise _Expired
                raise KubeApiError(f"watching EndpointSlices: {_message(response.status, body)}")
            pending = b""
            async for data in response.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line.strip():
                        self._event(json.loads(line))
                self._report(report)

    def _event(self, event: Mapping[str, Any]) -> None:
        kind, item = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if item.get("code") == 410:
                raise _Expired
            raise KubeApiError(f"watch error: {item.get('message', item)}")
        if kind in ("ADDED", "MODIFIED"):
            self._store(item)
        elif kind == "DELETED":
            self._slices.pop(item.get("metadata", {}).get("name", ""), None)

    def _store(self, item: Mapping[str, Any]) -> None:
        metadata = item.get("metadata") or {}
        labels = metadata.get("labels") or {}
        role = self.roles.get(labels.get(SERVICE_NAME_LABEL, ""))
        if role is None or labels.get(MANAGED_BY_LABEL) != SLICE_CONTROLLER:
            # Not (or no longer) one of the controller's slices of the pool's Services
            # (the selector should have kept it out): it adds no worker.
            self._slices.pop(metadata.get("name", ""), None)
            return
        self._slices[metadata["name"]] = (role, ready_urls(item, self.config.port))

    def _report(self, report: Report) -> None:
        """Tell each role's full list, when it changed."""
        for role in set(self.roles.values()):
            urls = sorted({url for r, found in self._slices.values() if r == role for url in found})
            if self._reported.get(role) != urls:
                self._reported[role] = urls
                log.info("%s workers: %s", role, ", ".join(urls) or "none")
                report(role, urls)


def _message(status: int, body: Any) -> str:
    message = body.get("message") if isinstance(body, dict) else None
    return f"HTTP {status}: {message or body}"
