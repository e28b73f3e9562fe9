"""A worker's KV event feed: `/pd/kv/snapshot`, `/pd/kv/stream` and `/pd/kv/events`
(see `pdserve.workers.kv_wire`), behind the pool's credential like every `/pd/*` path.

The engine's block pool reports to a `KVEventLog`; this serves it. A stream is one
long-lived answer per subscriber: each time the engine publishes a step's events,
every open stream is woken and writes what its subscriber lacks as one line. A
stream keeps no events of its own: it reads them from the log's bounded buffer when
it is woken, so a subscriber that falls behind (it reads slowly, its writes wait for
the connection to drain) costs the worker nothing beyond the log and the
connection's send buffer. When it wakes to find its next event no longer kept, it
writes a gap and ends; the subscriber reads a snapshot. (A subscriber that takes
nothing at all is cut by the connection's write deadline, `--timeout-write`.)

An events request (the long poll, for subscribers that poll) that finds nothing new
waits (up to `wait_ms`) for the log's next change. Both cost the worker's loop one
wake-up per published step; the stream spares the request, its parsing and the
answer's head that each poll costs on both sides."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from pdserve.protocol.api_errors import APIError
from pdserve.protocol.openapi import Endpoint, QueryParameter
from pdserve.workers.engine.kv_events import (
    HASH_FUNCTION,
    KVEvent,
    KVEventLog,
    KVEventsSince,
    seed_fingerprint,
)
from pdserve.workers.kv_wire import (
    EVENTS_PATH,
    HEARTBEAT_S,
    MAX_LINE_EVENTS,
    MAX_WAIT_MS,
    SNAPSHOT_PATH,
    STREAM_CONTENT_TYPE,
    STREAM_PATH,
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
        "get", STREAM_PATH, "The prefix cache's events after a number, then as they come: "
        "one line (a KV events body) per step that changed the cache, an empty one every "
        f"{HEARTBEAT_S:g} s meanwhile; a line with gap ends it: read the snapshot",
        KVEventsBody, internal=True, media=STREAM_CONTENT_TYPE,
        parameters=(
            QueryParameter("epoch", "the epoch the subscriber follows", {"type": "string"}),
            QueryParameter(
                "after", "the last event number the subscriber has",
                {"type": "integer", "minimum": 0, "default": 0},
            ),
        ),
        errors=((400, "a query parameter that is not a whole number"), *_FEED_ERRORS),
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
        # One per open stream or waiting events request: set when the log publishes.
        self._readers: set[asyncio.Event] = set()
        self._closing = False

    def add_routes(self, app: web.Application) -> None:
        """Mount the feed's endpoints; changes are signalled on the serving loop, and
        open streams end when the server shuts down."""
        app.router.add_get(SNAPSHOT_PATH, self.snapshot)
        app.router.add_get(STREAM_PATH, self.stream)
        app.router.add_get(EVENTS_PATH, self.events)
        app.on_startup.append(self._bind_loop)
        app.on_shutdown.append(self._close)

    @property
    def streams(self) -> int:
        """Open streams and waiting events requests."""
        return len(self._readers)

    async def _bind_loop(self, _: web.Application) -> None:
        loop = asyncio.get_running_loop()
        readers = self._readers

        def wake() -> None:
            for reader in readers:
                reader.set()

        def signal() -> None:
            # From the engine's thread, once per step that changed the cache.
            if readers:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(wake)

        self.log.on_change = signal

    async def _close(self, _: web.Application) -> None:
        """End every stream (a stopping worker waits for no subscriber)."""
        self._closing = True
        for reader in self._readers:
            reader.set()

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

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """GET /pd/kv/stream?epoch=E&after=N."""
        epoch = request.query.get("epoch", "")
        seq = _int_query(request, "after", 0)
        response = web.StreamResponse(
            headers={"Content-Type": STREAM_CONTENT_TYPE, "Cache-Control": "no-store"}
        )
        response.enable_chunked_encoding()
        await response.prepare(request)
        woken = asyncio.Event()
        self._readers.add(woken)
        try:
            due = True  # the first line goes at once, then one after a quiet heartbeat
            while not self._closing:
                woken.clear()  # before reading: a publish from now on ends the next wait
                found = self.log.since(epoch, seq)
                if due or found.events or found.gap:
                    await response.write(_lines(found))
                if found.gap:
                    break
                seq = found.seq
                try:
                    async with asyncio.timeout(HEARTBEAT_S):
                        await woken.wait()
                    due = False
                except TimeoutError:
                    due = True
        finally:
            self._readers.discard(woken)
        return response

    async def events(self, request: web.Request) -> web.Response:
        """GET /pd/kv/events?epoch=E&after=N&wait_ms=W."""
        epoch = request.query.get("epoch", "")
        after = _int_query(request, "after", 0)
        wait_s = min(_int_query(request, "wait_ms", 0), MAX_WAIT_MS) / 1000
        found = self.log.since(epoch, after)
        if not found.gap and not found.events and wait_s > 0 and not self._closing:
            woken = asyncio.Event()
            self._readers.add(woken)
            try:
                found = self.log.since(epoch, after)  # a change before the reader was added
                if not found.events:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woken.wait(), wait_s)
                    found = self.log.since(epoch, after)
            finally:
                self._readers.discard(woken)
        return web.json_response(_events_json(found, found.events))


def _lines(found: KVEventsSince) -> bytes:
    """A stream's lines for what `since` found: its events, at most MAX_LINE_EVENTS a
    line (one line without any, to say the stream lives or that it has a gap)."""
    events = found.events
    parts = [events[at : at + MAX_LINE_EVENTS] for at in range(0, len(events), MAX_LINE_EVENTS)]
    lines = [json.dumps(_events_json(found, part), separators=(",", ":")) for part in parts or [()]]
    return ("\n".join(lines) + "\n").encode()


def _events_json(found: KVEventsSince, events: Sequence[KVEvent]) -> dict[str, Any]:
    """A KVEventsBody of `events`, as JSON: built directly, as the wire models describe
    (and validate) it on the subscriber's side, and an answer is on the worker's time."""
    return {
        "epoch": found.epoch,
        "seq": found.seq,
        "events": [
            {"seq": event.seq, "kind": event.kind, "hashes": [h.hex() for h in event.hashes]}
            for event in events
        ],
        "gap": found.gap,
    }


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
