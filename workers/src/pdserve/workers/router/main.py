"""Assembling and running a router: the routing table, the tokenizer, the credential,
the workers' discovery and load polling, and the HTTP server."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from pdserve.base.ports import PortInUseError, announce_port, binding, check_port_free
from pdserve.protocol.internal import CredentialError, bearer, read_credential
from pdserve.protocol.limits import Admission, RequestLimits
from pdserve.protocol.routing import (
    KubernetesDiscovery,
    RoutingFileError,
    RoutingTable,
    read_table,
)
from pdserve.workers.compiled import build_in_use
from pdserve.workers.engine.kv_events import seed_fingerprint
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.network.guard import NetworkGuard
from pdserve.workers.network.http1 import Http1Server
from pdserve.workers.network.limits import NetworkLimits
from pdserve.workers.network.metrics import NetworkMetrics
from pdserve.workers.router.app import RouterServer
from pdserve.workers.router.auth import ApiKeyError, ApiKeys
from pdserve.workers.router.kv_metrics import KVRoutingMetrics
from pdserve.workers.router.kv_scoring import KVScorer
from pdserve.workers.router.kv_subscriber import Expected, KVFeeds
from pdserve.workers.router.load import LoadPoller
from pdserve.workers.router.metrics import ROLE, RouterMetrics
from pdserve.workers.router.options import RouterOptions
from pdserve.workers.router.proxy import CONNECT_TIMEOUT_S, Forwarder
from pdserve.workers.router.upstream import Upstreams
from pdserve.workers.router.workers import WorkerSet

log = logging.getLogger("pdserve.router")

# How long a stopping router lets streams in flight finish.
SHUTDOWN_GRACE_S = 30.0


@dataclass(frozen=True)
class Startup:
    """What the router reads before it serves; any of it missing stops the start."""

    table: RoutingTable
    table_bytes: bytes
    tokenizer: Tokenizer
    credential: str | None
    api_keys: ApiKeys


def prepare(options: RouterOptions) -> Startup:
    """Read the routing file, the tokenizer, the credential and the keys; raises
    (RoutingFileError, CredentialError, ApiKeyError, OSError, ValueError) naming the
    problem."""
    table_bytes, table = read_table(options.config)
    tokenizer = Tokenizer.from_dir(table.model.path)
    credential = None
    if options.internal_token_file is not None:
        credential = read_credential(options.internal_token_file)
    elif any(bucket.mode == "disaggregated" for bucket in table.buckets):
        log.warning("no --internal-token-file: workers will refuse hand-offs")
    if isinstance(table.discovery, KubernetesDiscovery):
        from pdserve.workers.router.kubernetes import load_access

        load_access(options.kubeconfig)  # fails now, not in the background
    return Startup(table, table_bytes, tokenizer, credential, ApiKeys(options.api_key_file))


async def run_router(
    options: RouterOptions, limits: RequestLimits, network: NetworkLimits, startup: Startup
) -> None:
    """Serve until SIGINT/SIGTERM."""
    # The requests go through `upstreams`; the session polls loads and follows feeds.
    connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
    upstreams = Upstreams(CONNECT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector) as session:
        metrics = RouterMetrics(startup.table.pool)
        guard = NetworkGuard(network, NetworkMetrics(metrics.registry, metrics.pool, ROLE))
        feeds = kv_feeds(session, startup, KVRoutingMetrics(metrics.pool, metrics.registry))
        forwarder = Forwarder(
            upstreams, WorkerSet("prefill"), WorkerSet("decode"), startup.credential, metrics,
            options.max_attempts, KVScorer(feeds, feeds.metrics),
        )  # fmt: skip
        admission = Admission(options.max_queued_requests, lambda: forwarder.awaiting_first_token)
        server = RouterServer(
            startup.table, startup.table_bytes, startup.tokenizer, forwarder, limits, admission,
            startup.api_keys, options.kubeconfig, feeds,
        )  # fmt: skip
        # What starting made (modules, the tokenizer, the table) lives as long as the
        # process: out of the collector's way, a full collection scans only what
        # serving made since (a few microseconds less per request).
        gc.freeze()
        try:
            await _serve(server, options, guard, LoadPoller(session, server.sets.values()))
        finally:
            await feeds.stop()
            upstreams.close()


def kv_feeds(
    session: aiohttp.ClientSession, startup: Startup, metrics: KVRoutingMetrics
) -> KVFeeds:
    """The subscriptions to the workers' KV event feeds (followed whatever the
    routing policy, so a table switched to KV-aware finds the index warm)."""
    table = startup.table
    policy = table.routing_policy
    expected = Expected(
        policy.block_size, table.model.name, hash_seed=seed_fingerprint(policy.hash_seed)
    )
    headers = bearer(startup.credential) if startup.credential else {}
    return KVFeeds(session, headers, expected, metrics)


async def _serve(
    server: RouterServer, options: RouterOptions, guard: NetworkGuard, poller: LoadPoller
) -> None:
    source = server.start_discovery()
    background = [
        asyncio.create_task(poller.run(), name="load polling"),
        asyncio.create_task(server.watch_table(options.config), name="routing file"),
    ]
    http = Http1Server(server.routes(), guard, server.limits.max_body_size)
    with binding(options.host, options.port):
        port = await http.listen(options.host, options.port)
    if options.port_file is not None:
        announce_port(options.port_file, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    synced = asyncio.create_task(source.synced.wait())
    await asyncio.wait({stopping, synced}, return_when=asyncio.FIRST_COMPLETED)
    synced.cancel()
    if not stop.is_set():
        server.ready = True
        log.info(
            "router ready on http://%s:%d (pool %s; its hot modules: %s)",
            options.host,
            port,
            server.table.pool,
            build_in_use(),
        )
        await stopping
    server.ready = False
    await http.shutdown(SHUTDOWN_GRACE_S)
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await server.stop_discovery()


def serve(options: RouterOptions, limits: RequestLimits, network: NetworkLimits) -> int:
    """`pdserve router`: returns the exit code (2: it could not start)."""
    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        startup = prepare(options)
        check_port_free(options.host, options.port)
    except (RoutingFileError, CredentialError, ApiKeyError, OSError, ValueError) as error:
        print(f"pdserve router: {error}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(run_router(options, limits, network, startup))
    except PortInUseError as error:  # taken since the check
        print(f"pdserve router: {error}", file=sys.stderr)
        return 2
    return 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (its sockets, timers and callbacks in
    C: a large share of a router's time per request is the loop's); else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
