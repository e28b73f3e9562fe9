"""Reading objects from the API server in-process, for the tests' polling.

The tests wait on the cluster by reading it again and again (a pool's status, its
children, Events). Through kubectl each read starts a process (about 0.1 s of CPU, and
several times that in wall time on a busy machine), and that CPU is taken from the
control plane and the operator the test is waiting for. `read` answers the same
`kubectl get ... -o json` with one HTTPS GET per kind, as the same user (the
kubeconfig's client certificate); forms it does not know are left to kubectl.
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import os
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdserve.operator import api

# How long one GET may take; a starved API server can be slow, kubectl has no limit.
TIMEOUT_S = 60.0
# client-go retries a 429 or 5xx that carries Retry-After (as a new CRD's lists do
# while its cache fills) up to 10 times; so does this.
RETRIES = 10


@dataclass(frozen=True)
class Resource:
    """Where a kind is served: the API group's path, its plural, and its scope."""

    prefix: str
    plural: str
    namespaced: bool = True


def _table() -> dict[str, Resource]:
    core, apps, rbac = "/api/v1", "/apis/apps/v1", "/apis/rbac.authorization.k8s.io/v1"
    kinds = [
        # (prefix, plural, namespaced, other names kubectl accepts)
        (core, "pods", True, ("pod", "po")),
        (core, "services", True, ("service", "svc")),
        (core, "configmaps", True, ("configmap", "cm")),
        (core, "secrets", True, ("secret",)),
        (core, "serviceaccounts", True, ("serviceaccount", "sa")),
        (core, "events", True, ("event", "ev")),
        (core, "namespaces", False, ("namespace", "ns")),
        (core, "nodes", False, ("node", "no")),
        (apps, "deployments", True, ("deployment", "deploy")),
        (apps, "replicasets", True, ("replicaset", "rs")),
        (rbac, "roles", True, ("role",)),
        (rbac, "rolebindings", True, ("rolebinding",)),
        (rbac, "clusterroles", False, ("clusterrole",)),
        (rbac, "clusterrolebindings", False, ("clusterrolebinding",)),
        ("/apis/policy/v1", "poddisruptionbudgets", True, ("poddisruptionbudget", "pdb")),
        ("/apis/networking.k8s.io/v1", "networkpolicies", True, ("networkpolicy", "netpol")),
        (f"/apis/{api.API_VERSION}", "servingpools", True, ("servingpool", "sp")),
        ("/apis/monitoring.coreos.com/v1", "servicemonitors", True, ("servicemonitor",)),
        (
            "/apis/apiextensions.k8s.io/v1",
            "customresourcedefinitions",
            False,
            ("customresourcedefinition", "crd", "crds"),
        ),
    ]
    table = {}
    for prefix, plural, namespaced, names in kinds:
        for name in (plural, *names):
            table[name] = Resource(prefix, plural, namespaced)
    return table


RESOURCES = _table()


@dataclass(frozen=True)
class Get:
    """A `kubectl get` this module answers: kinds, an optional name, and filters."""

    resources: tuple[Resource, ...]
    name: str | None
    namespace: str
    labels: str | None
    fields: str | None


def parse(args: Sequence[str]) -> Get | None:
    """The `kubectl get` arguments (after `get`, before `-o json`) as a Get, or None
    where they use a form this module leaves to kubectl."""
    positional: list[str] = []
    options: dict[str, str] = {}
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg in ("-n", "--namespace", "-l", "--selector", "--field-selector"):
            if not rest:
                return None
            options[arg] = rest.pop(0)
        elif arg.startswith("-"):
            return None
        else:
            positional.append(arg)
    if not 1 <= len(positional) <= 2:
        return None
    kinds = positional[0].split(",")
    if any(kind not in RESOURCES for kind in kinds):
        return None
    name = positional[1] if len(positional) == 2 else None
    filtered = "-l" in options or "--selector" in options or "--field-selector" in options
    if name is not None and (len(kinds) > 1 or "/" in name or filtered):
        return None
    namespace = options.get("-n") or options.get("--namespace") or "default"
    return Get(
        resources=tuple(RESOURCES[kind] for kind in kinds),
        name=name,
        namespace=namespace,
        labels=options.get("-l") or options.get("--selector"),
        fields=options.get("--field-selector"),
    )


class NotServed(Exception):
    """The API server serves no such kind (kubectl would say so, not NotFound)."""


class ApiClient:
    """GETs on one API server as the user of a kubeconfig (client certificate)."""

    def __init__(self, kubeconfig: dict[str, Any]) -> None:
        contexts = {c["name"]: c["context"] for c in kubeconfig["contexts"]}
        context = contexts[kubeconfig["current-context"]]
        cluster = {c["name"]: c["cluster"] for c in kubeconfig["clusters"]}[context["cluster"]]
        user = {u["name"]: u["user"] for u in kubeconfig["users"]}[context["user"]]
        self.server = cluster["server"].rstrip("/")
        self._address = urllib.parse.urlsplit(self.server)
        self._local = threading.local()
        ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
        self._context = ssl.create_default_context(cadata=ca)
        # The ssl module loads a certificate and key from files only: a private folder
        # holds them while they are read.
        with tempfile.TemporaryDirectory(prefix="pdserve-apiclient-") as folder:
            cert, key = Path(folder) / "client.crt", Path(folder) / "client.key"
            for path, field in ((cert, "client-certificate-data"), (key, "client-key-data")):
                path.touch(mode=0o600)
                path.write_bytes(base64.b64decode(user[field]))
            self._context.load_cert_chain(str(cert), str(key))

    def get(self, path: str) -> tuple[int, Any]:
        """Status and decoded body of GET `path` (retried as client-go does)."""
        for attempt in range(RETRIES + 1):
            status, headers, body = self._exchange(path)
            wait = headers.get("Retry-After")
            if (status == 429 or status >= 500) and wait and attempt < RETRIES:
                time.sleep(min(float(wait), 10.0) if wait.isdigit() else 1.0)
                continue
            try:
                return status, json.loads(body)
            except ValueError:
                return status, {"message": body.decode(errors="replace")}
        raise AssertionError("unreachable")

    def _exchange(self, path: str) -> tuple[int, http.client.HTTPMessage, bytes]:
        # One connection per thread, kept open: a TLS handshake per read would cost
        # more than the read.
        for fresh in (False, True):
            connection = getattr(self._local, "connection", None)
            if connection is None or fresh:
                if connection is not None:
                    connection.close()
                connection = http.client.HTTPSConnection(
                    self._address.hostname or "", self._address.port,
                    timeout=TIMEOUT_S, context=self._context,
                )  # fmt: skip
                self._local.connection = connection
            try:
                connection.request("GET", path, headers={"Accept": "application/json"})
                response = connection.getresponse()
                return response.status, response.headers, response.read()
            except (http.client.HTTPException, ConnectionError):
                if fresh:  # a kept connection the server closed gets one more try
                    raise
        raise AssertionError("unreachable")

    def read(self, get: Get) -> Any:
        """What `kubectl get ... -o json` prints for `get` (None where the named object
        is not there: kubectl's NotFound)."""
        if get.name is not None:
            (resource,) = get.resources
            status, body = self.get(_path(resource, get.namespace) + "/" + get.name)
            if status == 404 and (body.get("details") or {}).get("name") == get.name:
                return None
            return _shown(_ok(status, body))
        items: list[dict[str, Any]] = []
        query = {"labelSelector": get.labels, "fieldSelector": get.fields}
        encoded = urllib.parse.urlencode({k: v for k, v in query.items() if v})
        for resource in get.resources:
            path = _path(resource, get.namespace) + (f"?{encoded}" if encoded else "")
            listed = _ok(*self.get(path))
            # kubectl names each item's kind and version; a list's items carry neither.
            kind = str(listed["kind"]).removesuffix("List")
            for item in listed["items"]:
                items.append(_shown({"apiVersion": listed["apiVersion"], "kind": kind, **item}))
        return {
            "apiVersion": "v1",
            "kind": "List",
            "items": items,
            "metadata": {"resourceVersion": ""},
        }


def _shown(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as kubectl prints it: without metadata.managedFields."""
    obj.get("metadata", {}).pop("managedFields", None)
    return obj


def _path(resource: Resource, namespace: str) -> str:
    where = f"/namespaces/{namespace}" if resource.namespaced else ""
    return f"{resource.prefix}{where}/{resource.plural}"


def _ok(status: int, body: Any) -> Any:
    if status == 200:
        return body
    if status == 404 and not (body.get("details") or {}).get("name"):
        raise NotServed(body.get("message", ""))
    raise AssertionError(f"API server answered {status}: {body.get('message', body)}")


@functools.cache
def _client(kubeconfig: str, modified: int) -> ApiClient | None:
    try:
        return ApiClient(yaml.safe_load(Path(kubeconfig).read_text()))
    except (KeyError, TypeError):  # a token, or files named instead of data: kubectl's job
        return None


def client(kubeconfig: Path) -> ApiClient | None:
    """The client for `kubeconfig` (made once per file and version of it), or None
    where the kubeconfig authenticates otherwise than with embedded certificates."""
    return _client(str(kubeconfig), os.stat(kubeconfig).st_mtime_ns)
