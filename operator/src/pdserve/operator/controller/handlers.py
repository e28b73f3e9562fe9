"""kopf handlers: thin adapters from kopf's callbacks to the Reconciler.

- A ServingPool created, changed (spec) or found at start-up: reconcile it.
- A child (anything labelled pdserve.dev/pool) added, changed or deleted: put it
  back if needed; Deployment news refreshes the pool's status.
- Pools and children are cached (cache.py) from the watches kopf keeps anyway,
  primed by one read before they start, so deciding that nothing needs writing costs
  no request.
- What the watches cannot bring (a refused write, drift during a watch gap) is left
  to the background loop of resync.py: retries with backoff, and periodic resyncs.

kopf keeps its bookkeeping in annotations under pdserve.dev/: the status schema
has no room for it. Handlers return nothing for the same reason. No finalizers:
children go by garbage collection (owner references).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from typing import Any, cast

import kopf

from pdserve.operator import api, metrics, render
from pdserve.operator.controller import kube
from pdserve.operator.controller.cache import ClusterCache, PoolKey, cached_copy, pool_key
from pdserve.operator.controller.child_events import Changed, ChildEvents
from pdserve.operator.controller.kube import ApiError, Credentials, KubeClient
from pdserve.operator.controller.reconcile import Reconciler
from pdserve.operator.controller.resync import Resync, backoff
from pdserve.operator.options import OperatorOptions
from pdserve.operator.rollout import events as rollout_events
from pdserve.operator.rollout.loop import Rollouts
from pdserve.operator.scaling.autoscaler import Autoscaler

Obj = dict[str, Any]

log = logging.getLogger(__name__)

POOL = (api.API_VERSION, api.PLURAL)
HAS_POOL = {render.POOL_LABEL: kopf.PRESENT}
MAX_EVENT_MESSAGE = 1000


class KopfRecorder:
    """Posts Events through kopf's poster (batched, retried, off the handler's path)."""

    def normal(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        """An Event of type Normal on the pool."""
        self._post(pool, "Normal", reason, message)

    def warning(self, pool: Mapping[str, Any], reason: str, message: str) -> None:
        """An Event of type Warning on the pool."""
        self._post(pool, "Warning", reason, message)

    @staticmethod
    def _post(pool: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        text = message if len(message) <= MAX_EVENT_MESSAGE else message[:MAX_EVENT_MESSAGE] + "…"
        kopf.event(cast(kopf.Body, pool), type=type_, reason=reason, message=text)


def configure(settings: kopf.OperatorSettings, namespaces: Collection[str] = ()) -> None:
    """kopf settings: bookkeeping in annotations, quiet Events, filtered watches, and
    no cluster-wide observation when only named namespaces are watched."""
    persistence = settings.persistence
    persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration"
    )
    persistence.finalizer = f"{api.GROUP}/finalizer"
    # kopf would post an Event per handler run; the reconciler posts what matters.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "pdserve-operator"
    # Only children reach the operator: the API server filters the watches.
    for kind in kube.WATCHED_KINDS:
        settings.watching.label_selectors[kind.api_version, kind.plural] = render.POOL_LABEL
    # kopf lists namespaces and watches CRDs (both cluster-scoped) to follow namespace
    # patterns and CRDs installed later. Named namespaces need neither, so a namespaced
    # install runs on Roles alone; the CRD must exist before the operator starts.
    settings.scanning.disabled = named_namespaces_only(namespaces)


def named_namespaces_only(namespaces: Collection[str]) -> bool:
    """Whether the operator watches a fixed list of namespaces (no pattern, not all)."""
    patterns = ("*", "?", "!", ",")
    return bool(namespaces) and not any(c in ns for ns in namespaces for c in patterns)


def reconciler(memo: Mapping[str, Any]) -> Reconciler:
    """The reconciler that start-up put in the operator's memo."""
    found: Reconciler = memo["reconciler"]
    return found


def resync(memo: Mapping[str, Any]) -> Resync:
    """The retry and resync loop that start-up put in the operator's memo."""
    found: Resync = memo["resync"]
    return found


def rollouts(memo: Mapping[str, Any]) -> Rollouts:
    """The pools' rollout loops that start-up put in the operator's memo."""
    found: Rollouts = memo["rollouts"]
    return found


def autoscaler(memo: Mapping[str, Any]) -> Autoscaler:
    """The pools' autoscaler loops that start-up put in the operator's memo."""
    found: Autoscaler = memo["autoscaler"]
    return found


# --- start and stop ----------------------------------------------------------------------


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Configure kopf; connect the reconciler to the API server (the credentials and
    options are in the memo: main.py checked them before kopf started)."""
    options: OperatorOptions = memo["options"]
    configure(settings, options.namespace)
    client = KubeClient(memo["credentials"])
    try:
        served = [kind for kind in kube.OPTIONAL_KINDS if await client.serves(kind)]
    except BaseException:
        await client.close()
        raise
    recorder = KopfRecorder()
    memo["reconciler"] = found = Reconciler(
        client, recorder, served=served, default_image=options.default_image,
        prometheus_url=options.prometheus_url, prometheus_namespace=options.prometheus_namespace,
    )  # fmt: skip
    memo["cache"] = known = ClusterCache()
    memo["resync"] = loop = Resync(
        found, client, known, namespaces=options.namespace, interval=options.resync_interval
    )
    memo["autoscaler"] = Autoscaler(found, loop, recorder, prometheus_url=options.prometheus_url)
    memo["rollouts"] = Rollouts(
        found, loop, client, recorder, prometheus_url=options.prometheus_url
    )
    memo["children"] = ChildEvents(lambda key, changed: repair_children(memo, key, changed))
    await prime(known, loop)
    metrics.POOLS.set_function(lambda: len(found.tracked()))
    metrics.RETRIES_PENDING.set_function(loop.pending)


async def prime(known: ClusterCache, loop: Resync, attempts: int = 5) -> None:
    """Fill the cache from one read of every pool and child, before the watches start
    (their listings then bring nothing the resumed pools' reconciles lack). Without
    it the operator still works, at the cost of reapplying what it cannot see."""
    for attempt in range(attempts):
        try:
            await loop.refresh_cache()
        except ApiError as error:
            log.warning("cannot read the pools and their children yet: %s", error)
            await asyncio.sleep(backoff(attempt))
            continue
        log.info("cached %d objects: the pools and their children", len(known))
        return
    log.warning("starting without a primed cache: resumed pools are applied in full")


@kopf.on.login()
def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf connects with the same credentials as the reconciler's client."""
    credentials: Credentials = memo["credentials"]
    scheme, token = credentials.token()
    ca, certificate, key = credentials.files()
    return kopf.ConnectionInfo(
        server=credentials.server,
        ca_path=ca,
        insecure=credentials.ssl_context is False,
        scheme=scheme,
        token=token,
        certificate_path=certificate,
        private_key_path=key,
    )


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    """Stop handling children's events; stop the autoscaler, rollout and resync loops;
    close the reconciler's connections."""
    if "children" in memo:
        await child_events(memo).close()
    if "autoscaler" in memo:
        await autoscaler(memo).close()
    if "rollouts" in memo:
        await rollouts(memo).close()
    if "resync" in memo:
        await resync(memo).close()
    if "reconciler" in memo:
        await reconciler(memo).close()


def child_events(memo: Mapping[str, Any]) -> ChildEvents:
    """The children's events not handled yet, which start-up put in the operator's memo."""
    found: ChildEvents = memo["children"]
    return found


def cache(memo: Mapping[str, Any]) -> ClusterCache:
    """The pools and children start-up put in the operator's memo."""
    found: ClusterCache = memo["cache"]
    return found


# --- pools ---------------------------------------------------------------------------------


@kopf.on.resume(*POOL)
@kopf.on.create(*POOL)
@kopf.on.update(*POOL, field="spec")
async def reconcile_pool(body: kopf.Body, reason: str, retry: int, memo: Any, **_: Any) -> None:
    """Apply the pool's rendered objects, prune the rest, write its status (kopf
    retries a refused write, with backoff)."""
    pool = cached_copy(body)
    children = cache(memo).children(pool_key(pool))
    try:
        await reconciler(memo).reconcile(pool, children, trigger=str(reason))
    except api.InvalidPoolError as error:
        raise kopf.PermanentError("; ".join(error.errors)) from None
    except ApiError as error:
        raise kopf.TemporaryError(str(error), delay=backoff(retry)) from None


@kopf.on.event(*POOL)
async def pool_event(
    type: str | None,
    uid: str,
    namespace: str | None,
    name: str,
    body: kopf.Body,
    memo: Any,
    **_: Any,
) -> None:
    """Forget a deleted pool; start the resync loop once there is a pool to keep (a
    retry scheduled for a pool before its first event here waits for that); give the
    autoscaler and the rollout loop the pool's latest state."""
    if "resync" not in memo:
        return
    if type == "DELETED":
        cache(memo).drop_pool(body)
        reconciler(memo).forget(uid)
        resync(memo).forget((namespace or "", name))
        autoscaler(memo).forget((namespace or "", name))
        rollouts(memo).forget((namespace or "", name))
        rollout_events.forget(namespace or "", name)
    else:
        pool = cache(memo).put_pool(body)
        resync(memo).start()
        autoscaler(memo).track(pool)
        rollouts(memo).track(pool)


# --- children ------------------------------------------------------------------------------


async def child_event(
    type: str | None,
    body: kopf.Body,
    namespace: str | None,
    labels: kopf.Labels,
    memo: Any,
    **_: Any,
) -> None:
    """Cache the child; have its pool's task put it back if changed or deleted and
    refresh the status on Deployment news (child_events.py: why not here)."""
    if "children" not in memo:
        return
    known = cache(memo)
    if type == "DELETED":
        known.drop_child(body)
    else:
        known.put_child(body)
    if type is None:  # the initial listing: the pools' resume handlers cover it
        return
    metrics.WATCH_EVENTS.labels(kind=body.get("kind", "")).inc()
    key = (namespace or "", labels[render.POOL_LABEL])
    if known.pool(key) is not None:
        child_events(memo).note(key, type, cached_copy(body))


async def repair_children(memo: Mapping[str, Any], key: PoolKey, changed: Changed) -> None:
    """Each changed child of one pool put back if needed, against the cache as it is
    now; a refused repair is retried with backoff (no further event may come)."""
    known = cache(memo)
    for event, child in changed.values():
        pool = known.pool(key)
        if pool is None:
            return  # deleted meanwhile
        try:
            await reconciler(memo).child_changed(pool, child, event, known.children(key))
        except ApiError:
            resync(memo).retry(key)


for _kind in kube.WATCHED_KINDS:
    kopf.on.event(_kind.api_version, _kind.plural, id="child_event", labels=HAS_POOL)(child_event)
