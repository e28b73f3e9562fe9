"""The operator's small Kubernetes API client: apply, delete, read, list, patch status.

Plain HTTPS through aiohttp (kopf's own transport), so handlers never block the event
loop. Credentials come from a kubeconfig or the pod's service account, read by the
`kubernetes` package's loader. Every request is counted in the operator's metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from pdserve.operator import metrics

Obj = dict[str, Any]

FIELD_MANAGER = "pdserve"
HEADER_REFRESH_SECONDS = 60.0
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML
MERGE_CONTENT_TYPE = "application/merge-patch+json"
JSON_PATCH_CONTENT_TYPE = "application/json-patch+json"
LIST_PAGE = 500  # objects per list request


@dataclass(frozen=True)
class Kind:
    """A namespaced resource kind the operator writes."""

    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        """The API group ("" for the core group)."""
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        """The API version within the group."""
        return self.api_version.rpartition("/")[2]

    @property
    def root(self) -> str:
        """The URL path of the kind's API group version."""
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"

    def path(self, namespace: str | None, name: str | None = None) -> str:
        """The URL path of the collection in a namespace (every namespace: None), or of
        one object."""
        if namespace is None:
            return f"{self.root}/{self.plural}"
        collection = f"{self.root}/namespaces/{namespace}/{self.plural}"
        return collection if name is None else f"{collection}/{name}"


# The kinds a ServingPool's children can have, in render order.
CONFIG_MAP = Kind("v1", "ConfigMap", "configmaps")
SERVICE_ACCOUNT = Kind("v1", "ServiceAccount", "serviceaccounts")
ROLE = Kind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
SERVICE = Kind("v1", "Service", "services")
SECRET = Kind("v1", "Secret", "secrets")
NETWORK_POLICY = Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
POD_DISRUPTION_BUDGET = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
HORIZONTAL_POD_AUTOSCALER = Kind(
    "autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"
)
SERVICE_MONITOR = Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
SCALED_OBJECT = Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects")
SERVING_POOL = Kind("pdserve.dev/v1alpha1", "ServingPool", "servingpools")
# Not a child the operator writes: the workers' pods, read for why they are not ready.
POD = Kind("v1", "Pod", "pods")

# Watched (and cached) by the operator; the kinds of CRDs a cluster may lack are read
# on demand instead (OPTIONAL_KINDS).
WATCHED_KINDS = (
    CONFIG_MAP,
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
    SERVICE,
    NETWORK_POLICY,
    DEPLOYMENT,
    POD_DISRUPTION_BUDGET,
    HORIZONTAL_POD_AUTOSCALER,
    POD,
)
OPTIONAL_KINDS = (SERVICE_MONITOR, SCALED_OBJECT)
OPTIONAL_NAMES = frozenset(kind.kind for kind in OPTIONAL_KINDS)
# Secrets are neither watched nor read: the operator only creates the pool's credential.
KINDS = {kind.kind: kind for kind in (*WATCHED_KINDS, *OPTIONAL_KINDS, SERVING_POOL, SECRET)}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    """The Kind of an object (KeyError for a kind the operator does not write)."""
    return KINDS[obj["kind"]]


class ApiError(Exception):
    """The API server refused a request (or could not be reached: status 0)."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        self.status = status
        self.reason = reason
        super().__init__(f"{status} {reason}: {message}" if reason else f"{status}: {message}")


class Credentials:
    """Where the API server is and how to authenticate to it (client certificate or
    token; tokens are re-read when they expire, as the `kubernetes` loader does)."""

    def __init__(self, configuration: Any) -> None:
        self._configuration = configuration
        self._headers: dict[str, str] | None = None
        self._read_at = 0.0
        self.server: str = configuration.host.rstrip("/")
        self.ssl_context: ssl.SSLContext | bool = False
        if configuration.verify_ssl:
            self.ssl_context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
            if configuration.cert_file:
                self.ssl_context.load_cert_chain(configuration.cert_file, configuration.key_file)

    def token(self) -> tuple[str | None, str | None]:
        """(scheme, token) of a bearer token, or (None, None) when certificates are used."""
        header = self.headers().get("authorization", "")
        scheme, _, token = header.partition(" ")
        return (scheme, token) if token else ((None, scheme) if scheme else (None, None))

    def files(self) -> tuple[str | None, str | None, str | None]:
        """(CA, client certificate, client key) file paths; None where not used."""
        c = self._configuration
        return c.ssl_ca_cert or None, c.cert_file or None, c.key_file or None

    def headers(self) -> dict[str, str]:
        """The authentication headers for the next request (re-read every minute: the
        loader's refresh is too slow to run per request, and tokens live far longer)."""
        now = time.monotonic()
        if self._headers is None or now - self._read_at > HEADER_REFRESH_SECONDS:
            refresh = self._configuration.refresh_api_key_hook
            if refresh is not None:
                refresh(self._configuration)
            settings = self._configuration.auth_settings().values()
            self._headers = {
                s["key"]: s["value"] for s in settings if s.get("in") == "header" and s["value"]
            }
            self._read_at = now
        return dict(self._headers)


class ConfigError(Exception):
    """No usable cluster configuration: the message says what is wrong and the fix."""


CONFIG_FIX = (
    "pass --kubeconfig PATH, set $KUBECONFIG, or run the operator in a pod "
    "(its service account is used)"
)
IN_CLUSTER_HOST = "KUBERNETES_SERVICE_HOST"  # set by the kubelet in every pod


def load_credentials(kubeconfig: Path | None = None) -> Credentials:
    """Credentials from `kubeconfig`, else $KUBECONFIG, else ~/.kube/config, else the
    pod's service account. ConfigError when there is none, or the one found is unusable.
    """
    from kubernetes import client, config  # only the loader: requests go through aiohttp

    source, files = _config_source(kubeconfig)
    configuration = client.Configuration()
    try:
        if files is None:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=files, client_configuration=configuration
            )
        return Credentials(configuration)
    except (config.ConfigException, OSError, ValueError, yaml.YAMLError) as error:
        why = " ".join(str(error).split())  # YAML errors span lines
        raise ConfigError(f"cannot use {source} ({why}): fix it, or {CONFIG_FIX}") from None


def _config_source(kubeconfig: Path | None) -> tuple[str, str | None]:
    """Where the configuration comes from, in words, and the kubeconfig file(s) to load
    (None: the pod's service account). ConfigError when there is nothing to load."""
    if kubeconfig is not None:
        if not kubeconfig.is_file():
            why = "not a file" if kubeconfig.exists() else "no such file"
            raise ConfigError(f"--kubeconfig {kubeconfig}: {why}: pass a kubeconfig file")
        return f"--kubeconfig {kubeconfig}", str(kubeconfig)
    paths = os.environ.get("KUBECONFIG", "")
    if paths:
        return f"$KUBECONFIG={paths}", paths
    default = Path.home() / ".kube" / "config"
    if default.is_file():
        return str(default), str(default)
    if os.environ.get(IN_CLUSTER_HOST):
        return "the pod's service account", None
    raise ConfigError(f"no cluster configuration found: {CONFIG_FIX}")


def _decode(text: str) -> Obj:
    """A JSON object from the API server; {} for an empty or non-JSON answer."""
    try:
        answer = json.loads(text) if text else {}
    except ValueError:  # e.g. a proxy's plain-text error page
        return {}
    return answer if isinstance(answer, dict) else {}


class KubeClient:
    """Requests to one API server over one pooled aiohttp session.

    At most `concurrency` requests are in flight; the others wait their turn before
    their timeout starts, so a burst of reconciles queues instead of timing out.
    """

    def __init__(
        self, credentials: Credentials, timeout: float = 30.0, concurrency: int = 16
    ) -> None:
        self._credentials = credentials
        self._slots = asyncio.Semaphore(concurrency)
        self._session = aiohttp.ClientSession(
            headers={"Accept": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(ssl=credentials.ssl_context, limit=concurrency),
        )

    async def close(self) -> None:
        """Close the connection pool."""
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        verb: str,
        resource: str,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Obj | None:
        """One request; the decoded answer, None for 404, ApiError for other failures."""
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        headers = self._credentials.headers()
        if data is not None:
            headers["Content-Type"] = content_type
        url = self._credentials.server + path
        try:
            async with (
                self._slots,
                self._session.request(
                    method, url, params=params, data=data, headers=headers
                ) as response,
            ):
                metrics.API_REQUESTS.labels(verb=verb, resource=resource).inc()
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            metrics.API_REQUESTS.labels(verb=verb, resource=resource).inc()
            why = str(error) or type(error).__name__
            raise ApiError(0, f"{method} {path}: {why}") from error
        if status == 404:
            return None
        answer = _decode(text)
        if status >= 400:
            raise ApiError(status, answer.get("message", text), answer.get("reason", ""))
        return answer

    async def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Server-side apply (field manager `pdserve`, conflicts forced); the live object."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        path = kind.path(meta["namespace"], meta["name"])
        params = {"fieldManager": FIELD_MANAGER, "force": "true"}
        live = await self.request(
            "PATCH",
            path,
            verb="apply",
            resource=kind.plural,
            params=params,
            body=obj,
            content_type=APPLY_CONTENT_TYPE,
        )
        if live is None:
            raise ApiError(404, f"{kind.kind} is not served by this cluster", "NotFound")
        return live

    async def create(self, obj: Mapping[str, Any]) -> Obj | None:
        """Create an object unless one of its name exists: the object created, or None
        (one of its name exists)."""
        kind = kind_of(obj)
        try:
            created = await self.request(
                "POST",
                kind.path(obj["metadata"]["namespace"]),
                verb="create",
                resource=kind.plural,
                params={"fieldManager": FIELD_MANAGER},
                body=obj,
            )
        except ApiError as error:
            if error.status == 409:
                return None
            raise
        if created is None:
            raise ApiError(404, f"{kind.kind} is not served by this cluster", "NotFound")
        return created

    async def delete(self, obj: Mapping[str, Any]) -> bool:
        """Delete this very object (uid precondition); False when it was already gone."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
            "preconditions": {"uid": meta["uid"]},
        }
        try:
            answer = await self.request(
                "DELETE",
                kind.path(meta["namespace"], meta["name"]),
                verb="delete",
                resource=kind.plural,
                body=body,
            )
        except ApiError as error:
            if error.status == 409:  # the uid changed: someone made a new one, keep it
                return False
            raise
        return answer is not None

    async def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        """One object, or None when it does not exist."""
        return await self.request(
            "GET", kind.path(namespace, name), verb="get", resource=kind.plural
        )

    async def list_objects(
        self,
        kind: Kind,
        namespace: str | None,
        label_selector: str | None = None,
        keep: Callable[[Obj], Obj] | None = None,
    ) -> list[Obj]:
        """Every object of a kind in a namespace (every namespace: None), read in pages;
        each carries its kind and apiVersion, which list answers leave out of items.
        [] when the kind is not served. `keep` makes what is kept of each object as its
        page arrives, so a list of thousands never holds them whole at once."""
        params = {"limit": str(LIST_PAGE)}
        if label_selector:
            params["labelSelector"] = label_selector
        items: list[Obj] = []
        while True:
            answer = await self.request(
                "GET", kind.path(namespace), verb="list", resource=kind.plural, params=params
            )
            if answer is None:
                return []
            head = {"apiVersion": kind.api_version, "kind": kind.kind}
            more = answer.get("metadata", {}).get("continue")
            page = ({**head, **item} for item in answer.pop("items", None) or ())
            items.extend(page if keep is None else map(keep, page))
            del answer, page  # this page's whole objects go before the next is read
            if not more:
                return items
            params = {**params, "continue": more}

    async def patch_status(
        self, namespace: str, name: str, uid: str, status: Mapping[str, Any]
    ) -> bool:
        """Replace the status of the pool with this uid; False when the name now holds
        another pool (or none).

        A patch goes to whatever object holds the name, so a reconcile of a deleted pool
        that ends after a pool of the same name was created would write the new pool's
        status. The JSON patch's `test` of the uid makes the API server refuse it
        instead (the status subresource ignores metadata in a merge patch)."""
        patch = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "add", "path": "/status", "value": dict(status)},  # add replaces
        ]
        return await self._patch_this(
            SERVING_POOL, namespace, name, uid, patch, JSON_PATCH_CONTENT_TYPE, "/status"
        )

    async def patch_annotations(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        uid: str,
        annotations: Mapping[str, str | None],
    ) -> bool:
        """Merge `annotations` into the object with this uid (None values remove keys);
        False when the name now holds another object (or none). The uid in the patch
        makes the API server refuse it for another object (uid is immutable)."""
        patch = {"metadata": {"uid": uid, "annotations": dict(annotations)}}
        return await self._patch_this(kind, namespace, name, uid, patch, MERGE_CONTENT_TYPE)

    async def _patch_this(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        uid: str,
        patch: Any,
        content_type: str,
        subresource: str = "",
    ) -> bool:
        """A patch that the API server refuses (422) unless `name` holds the object with
        `uid`; False for that refusal, which a read tells from any other 422."""
        try:
            await self.request(
                "PATCH",
                kind.path(namespace, name) + subresource,
                verb="patch",
                resource=kind.plural + subresource,
                body=patch,
                content_type=content_type,
            )
        except ApiError as error:
            if error.status != 422:
                raise
            live = await self.get(kind, namespace, name)
            if live is not None and live["metadata"]["uid"] == uid:
                raise
            return False
        return True

    async def serves(self, kind: Kind) -> bool:
        """Whether the cluster serves a kind (its CRD may be missing)."""
        answer = await self.request("GET", kind.root, verb="discover", resource=kind.plural)
        return answer is not None and any(
            r.get("name") == kind.plural for r in answer.get("resources", [])
        )
