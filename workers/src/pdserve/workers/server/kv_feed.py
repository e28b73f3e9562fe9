"""A worker's KV event feed: `/pd/kv/snapshot` and `/pd/kv/events` (see
`pdserve.workers.kv_wire`), behind the pool's credential like every `/pd/*` path.

The engine's block pool reports to a `KVEventLog`; this serves it. An events request
that finds nothing new waits (up to `wait_ms`) for the log's next change, so a
router learns of a stored block within one round trip of it, without polling."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from pdserve.protocol.api_errors import APIError
from pdserve.protocol.openapi import Endpoint, QueryParameter
from pdserve.workers.engine.kv_events import (
    HASH_FUNCTION,
    KVEvent,
    KVEventLog,
    seed_fingerprint,
)
from pdserve.workers.kv_wire import (
    EVENTS_PATH,
    MAX_WAIT_MS,
    SNAPSHOT_PATH,
    KVEventBody,
    KVEventsBody,
    KVIdentity,
    KVSnapshotBody,
)

_FEED_ERRORS = ((401, "without the pool's credential"),)
# The feed as the worker's OpenAPI document describes it.
FEED_ENDPOINTS = (
    Endpoint(
        "get", SNAPSHOT_PATH, "Every block hash the prefix cache holds, as of an event, "
        "and the worker's identity for the router's handshake", KVSnapshotBody,
        errors=_FEED_ERRORS, internal=True,
    ),
    Endpoint(
        "get", EVENTS_PATH, "The prefix cache's events after a number, waiting for one, "
        "or gap: read the snapshot", KVEventsBody, internal=True,
        parameters=(
            QueryParameter("epoch", "the epoch the subscriber follows", {"type": "string"}),
            QueryParameter(
                "after", "the last event number the subscriber has",
                {"type": "integer", "minimum": 0, "default": 0},
            ),
            QueryParameter(
                "wait_ms", f"how long to wait for an event when there is none (at most "
                f"{MAX_WAIT_MS} are waited)", {"type": "integer", "minimum": 0, "default": 0},
            ),
        ),
        errors=((400, "a query parameter that is not a whole number"), *_FEED_ERRORS),
    ),
)  # fmt: skip


def kv_identity(
    block_size: int, hash_seed: str, model: str, weights: str, num_blocks: int
) -> KVIdentity:
    """This worker's identity for the router's handshake."""
    return KVIdentity(
        block_size=block_size,
        hash_function=HASH_FUNCTION,
        hash_seed=seed_fingerprint(hash_seed),
        model=model,
        weights=weights,
        num_blocks=num_blocks,
    )


class KVFeed:
    """Serves a KV event log over HTTP."""

    def __init__(self, log: KVEventLog, identity: KVIdentity) -> None:
        self.log = log
        self.identity = identity
        self._changed: asyncio.Event | None = None

    def add_routes(self, app: web.Application) -> None:
        """Mount the feed's endpoints; changes are signalled on the serving loop."""
        app.router.add_get(SNAPSHOT_PATH, self.snapshot)
        app.router.add_get(EVENTS_PATH, self.events)
        app.on_startup.append(self._bind_loop)

    async def _bind_loop(self, _: web.Application) -> None:
        loop = asyncio.get_running_loop()
        changed = self._changed = asyncio.Event()

        def signal() -> None:
            # Once per wake-up, not per block: a prompt stores dozens at once. (Read
            # from the engine's thread: a stale answer costs one extra call at most.)
            if changed.is_set():
                return
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(changed.set)

        self.log.on_change = signal

    async def snapshot(self, _: web.Request) -> web.Response:
        """GET /pd/kv/snapshot."""
        taken = self.log.snapshot()
        # Built unvalidated: this worker's own hashes (a cache may hold 100k of them).
        body = KVSnapshotBody.model_construct(
            identity=self.identity,
            epoch=taken.epoch,
            seq=taken.seq,
            hashes=[block_hash.hex() for block_hash in taken.hashes],
        )
        return web.json_response(body.model_dump())

    async def events(self, request: web.Request) -> web.Response:
        """GET /pd/kv/events?epoch=E&after=N&wait_ms=W."""
        epoch = request.query.get("epoch", "")
        after = _int_query(request, "after", 0)
        wait_s = min(_int_query(request, "wait_ms", 0), MAX_WAIT_MS) / 1000
        found = self.log.since(epoch, after)
        if not found.gap and not found.events and wait_s > 0 and self._changed is not None:
            self._changed.clear()
            found = self.log.since(epoch, after)  # a change between the read and the clear
            if not found.events:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), wait_s)
                found = self.log.since(epoch, after)
        body = KVEventsBody.model_construct(
            epoch=found.epoch,
            seq=found.seq,
            events=[_event_body(event) for event in found.events],
            gap=found.gap,
        )
        return web.json_response(body.model_dump())


def _event_body(event: KVEvent) -> KVEventBody:
    return KVEventBody.model_construct(
        seq=event.seq, kind=event.kind, hashes=[block_hash.hex() for block_hash in event.hashes]
    )


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as error:
        raise APIError(400, f"{name} must be an integer, not {raw[:32]!r}") from error
    if value < 0:
        raise APIError(400, f"{name} must not be negative")
    return value
