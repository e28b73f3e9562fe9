"""The router's subscriptions to its workers' KV event feeds, which keep its index
(`kv_index`) of each role exact.

For each worker discovery reports, a task reads the worker's snapshot
(`/pd/kv/snapshot`, with the pool's credential), checks the handshake in it, loads the
worker's blocks into the index, then follows its events over one long-lived answer
(`/pd/kv/stream`: a line per step that changed the worker's cache). It reads a
snapshot again when the feed says events were missed (gap: also what a worker says
to a subscriber that fell further behind than it keeps), when the worker's epoch
changes (it restarted), when the connection breaks or the stream ends or falls
silent past a few heartbeats (reconnect, with backoff; the worker's blocks leave the
index meanwhile) or when the worker claims more blocks than its cache holds
(overflow). A worker without the stream (an earlier version, during a rolling
update) is followed by long-polling `/pd/kv/events`, as before.

The handshake fails loudly: a worker whose block size, hash function or seed differ
from the router's, that serves another model, or whose weights are not the pool's
(those most of the accepted workers hold), is refused for KV scoring: logged at
ERROR (at WARNING when it has no usable feed at all), counted
(`pdserve_router_kv_handshake_failures_total`), shown in `/workers`, left out of the
index, and asked again every `REFUSED_RETRY_S`. It still serves, competing on load
alone (it holds nothing in the index).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from pdserve.protocol.routing import ROLES, Role
from pdserve.workers.engine.kv_events import HASH_FUNCTION, HASH_SEED
from pdserve.workers.kv_wire import (
    EVENTS_PATH,
    HEARTBEAT_S,
    MAX_LINE_BYTES,
    SNAPSHOT_PATH,
    STREAM_PATH,
    KVEventBody,
    KVEventsBody,
    KVIdentity,
    KVSnapshotBody,
)
from pdserve.workers.router.kv_index import IndexFullError, KVIndex, block_key
from pdserve.workers.router.kv_metrics import KVRoutingMetrics

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)
FeedState = Literal["syncing", "synced", "refused", "unreachable"]
WAIT_MS = 5_000  # how long a worker holds an events request open (when polling)
SNAPSHOT_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
# A stream that says nothing for this long (it sends a heartbeat every HEARTBEAT_S)
# is taken for broken: the worker's host may be gone without closing it.
SILENT_S = 3 * HEARTBEAT_S
RETRY_MIN_S = 0.1
RETRY_MAX_S = 1.0  # a restarted worker is read again within this of its first answer
REFUSED_RETRY_S = 10.0


class KVFeedStatus(BaseModel):
    """A worker's KV feed, in GET /workers."""

    state: FeedState
    reason: str | None = None  # why it is refused or unreachable
    epoch: str | None = None
    seq: int = 0
    blocks: int = 0  # blocks of its prefix cache in the router's index


class RefusedError(Exception):
    """The handshake failed; `reason` names what differed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Resync(Exception):
    """The feed must be read whole again, for `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Expected:
    """What a worker's handshake must say for the router's hashes to name its blocks."""

    block_size: int
    model: str
    hash_function: str = HASH_FUNCTION
    hash_seed: str = HASH_SEED

    def check(self, identity: KVIdentity) -> None:
        """RefusedError naming the first thing that differs."""
        for field in ("block_size", "hash_function", "hash_seed", "model"):
            mine, theirs = getattr(self, field), getattr(identity, field)
            if mine != theirs:
                raise RefusedError(field, f"{field} is {theirs!r}, the router's is {mine!r}")


class PoolWeights:
    """The weights the pool's KV-scored workers hold: those of most accepted workers
    (the first accepted breaks a tie), so a rolling update moves the pool over once
    most workers have moved."""

    def __init__(self) -> None:
        self._held: dict[str, str] = {}  # accepted worker -> its weights digest

    def reference(self, besides: str | None = None) -> str | None:
        """The pool's weights now, from the accepted workers other than `besides`
        (None: no such worker)."""
        counts = Counter(w for url, w in self._held.items() if url != besides)
        return counts.most_common(1)[0][0] if counts else None  # ties: the first held

    def admit(self, url: str, weights: str) -> None:
        """Accept `url`'s weights, or RefusedError when they are not the pool's."""
        reference = self.reference(besides=url)
        if reference is not None and weights != reference:
            raise RefusedError("weights", f"weights {weights!r} are not the pool's ({reference!r})")
        self._held[url] = weights

    def forget(self, url: str) -> None:
        """`url` is no longer accepted."""
        self._held.pop(url, None)


class Subscription:
    """Keeps one worker's blocks in the index of its role."""

    def __init__(
        self,
        url: str,
        role: Role,
        index: KVIndex,
        feeds: KVFeeds,
    ) -> None:
        self.url = url
        self.role = role
        self.index = index
        self.feeds = feeds
        self.status = KVFeedStatus(state="syncing")
        self.synced_at: float | None = None
        self._polls = False  # the worker has no stream (asked again on reconnecting)

    async def run(self) -> None:
        """Follow the feed until cancelled."""
        reason, delay = "start", RETRY_MIN_S
        while True:
            try:
                await self._follow(reason)
            except _Resync as resync:
                reason, delay = resync.reason, RETRY_MIN_S
                continue
            except RefusedError as refused:
                self._refuse(refused)
                reason = "start"
                await asyncio.sleep(REFUSED_RETRY_S)
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                self._lost(error)
                reason = "reconnect"
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)

    async def _follow(self, reason: str) -> None:
        """Read a snapshot, then apply events until a resync is needed."""
        snapshot = await self._get(SNAPSHOT_PATH, KVSnapshotBody, SNAPSHOT_TIMEOUT_S)
        self.feeds.expected.check(snapshot.identity)
        self.feeds.weights.admit(self.url, snapshot.identity.weights)
        keys = (block_key(bytes.fromhex(text)) for text in snapshot.hashes)
        try:
            self.index.replace(self.url, keys, snapshot.identity.num_blocks)
        except IndexFullError as error:
            raise RefusedError("feed", f"its snapshot does not fit: {error}") from error
        self.feeds.metrics.resynced(self.role, reason)
        epoch, seq = snapshot.epoch, snapshot.seq
        self._synced(epoch, seq)
        log.info(
            "KV index of %s %s: %d blocks (epoch %s, %s)",
            self.role, self.url, self.index.blocks(self.url), epoch[:8], reason,
        )  # fmt: skip
        if not self._polls:
            await self._stream(epoch, seq)  # returns if the worker has no stream
        await self._poll(epoch, seq)

    async def _stream(self, epoch: str, seq: int) -> None:
        """Apply the stream's lines until a resync is needed (or the worker has no
        stream: then poll)."""
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=SILENT_S)
        query = {"epoch": epoch, "after": str(seq)}
        async with self.feeds.session.get(
            self.url + STREAM_PATH, params=query, headers=self.feeds.headers, timeout=timeout
        ) as response:
            if response.status == 404:
                log.info("%s has no KV event stream: polling its events", self.url)
                self._polls = True
                return
            self._check_status(STREAM_PATH, response)
            async for line in _lines(response.content):
                body = _validated(STREAM_PATH, KVEventsBody, line)
                if body.epoch != epoch:
                    raise _Resync("epoch")
                if body.gap:
                    raise _Resync("gap")
                if body.events:
                    seq = self._apply(body.events, seq)
                    self._synced(epoch, seq)
        raise aiohttp.ClientPayloadError("the worker ended its KV event stream")

    async def _poll(self, epoch: str, seq: int) -> None:
        """Long-poll the events until a resync is needed."""
        while True:
            query = {"epoch": epoch, "after": str(seq), "wait_ms": str(WAIT_MS)}
            body = await self._get(EVENTS_PATH, KVEventsBody, WAIT_MS / 1000 + 5, query)
            if body.epoch != epoch:
                raise _Resync("epoch")
            if body.gap:
                raise _Resync("gap")
            seq = self._apply(body.events, seq)
            self._synced(epoch, seq)

    def _apply(self, events: Iterable[KVEventBody], seq: int) -> int:
        """Apply events after `seq`; the last number applied."""
        for event in events:
            first = event.seq - max(1, len(event.hashes)) + 1
            if event.seq <= seq or first > seq + 1:
                raise _Resync("gap")
            hashes = event.hashes[len(event.hashes) - (event.seq - seq) :]
            keys = [block_key(bytes.fromhex(text)) for text in hashes]
            try:
                self.index.apply(self.url, event.kind, keys)
            except IndexFullError as error:
                log.warning("KV index of %s: %s; reading it again", self.url, error)
                raise _Resync("overflow") from error
            seq = event.seq
        return seq

    async def _get(
        self,
        path: str,
        model: type[Body],
        timeout_s: float,
        query: dict[str, str] | None = None,
    ) -> Body:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.feeds.session.get(
            self.url + path, params=query, headers=self.feeds.headers, timeout=timeout
        ) as response:
            self._check_status(path, response)
            raw: Any = await response.json()
        try:
            return model.model_validate(raw)
        except ValidationError as error:
            raise RefusedError("feed", f"{path} answered an unusable body: {error}") from error

    @staticmethod
    def _check_status(path: str, response: aiohttp.ClientResponse) -> None:
        if response.status in (401, 403, 404):
            raise RefusedError(
                "feed", f"{path} answered {response.status} (no KV feed for this router)"
            )
        response.raise_for_status()

    def _synced(self, epoch: str, seq: int) -> None:
        if self.status.state != "synced":
            self.synced_at = time.monotonic()
        blocks = self.index.blocks(self.url)
        self.status = KVFeedStatus(state="synced", epoch=epoch, seq=seq, blocks=blocks)

    def _refuse(self, refused: RefusedError) -> None:
        self.index.drop(self.url)
        self.feeds.weights.forget(self.url)
        first = self.status.state != "refused" or self.status.reason != str(refused)
        self.status = KVFeedStatus(state="refused", reason=str(refused))
        if first:
            # A worker that differs is a misconfigured pool: an error. One without a
            # usable feed (another version, another server) is only a warning.
            level = logging.WARNING if refused.reason == "feed" else logging.ERROR
            log.log(
                level, "%s worker %s refused for KV-aware routing (it serves by load only): %s",
                self.role, self.url, refused,
            )  # fmt: skip
            self.feeds.metrics.refused(self.role, refused.reason)

    def _lost(self, error: Exception) -> None:
        self.index.drop(self.url)
        self._polls = False  # a restarted worker may be of a version that streams
        if self.status.state != "unreachable":
            log.info("KV feed of %s lost: %s", self.url, error or type(error).__name__)
        self.status = KVFeedStatus(state="unreachable", reason=str(error)[:200] or None)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The lines of a stream's body, each at most MAX_LINE_BYTES (a longer one is a
    ValueError: the connection is dropped and read again)."""
    pending = bytearray()
    while chunk := await content.readany():
        pending += chunk
        end = pending.rfind(b"\n")
        if end >= 0:
            for line in bytes(pending[:end]).split(b"\n"):
                if line:
                    yield line
            del pending[: end + 1]
        if len(pending) > MAX_LINE_BYTES:
            raise ValueError(f"a KV event stream's line is over {MAX_LINE_BYTES} bytes")


def _validated(path: str, model: type[Body], line: bytes) -> Body:
    try:
        return model.model_validate_json(line)
    except ValidationError as error:
        raise RefusedError("feed", f"{path} sent an unusable line: {error}") from error


class KVFeeds:
    """The KV feeds of every worker the router knows, and the index of each role."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
        expected: Expected,
        metrics: KVRoutingMetrics,
        index: Callable[[], KVIndex] = KVIndex,
    ) -> None:
        self.session = session
        self.headers = headers
        self.expected = expected
        self.metrics = metrics
        self.weights = PoolWeights()
        self.indexes: dict[Role, KVIndex] = {role: index() for role in ROLES}
        self._subscriptions: dict[tuple[Role, str], tuple[Subscription, asyncio.Task[None]]] = {}

    def track(self, role: Role, urls: Iterable[str]) -> None:
        """Follow the feeds of `urls`, the workers of `role` now; stop following gone
        ones (their blocks leave the index)."""
        wanted = set(urls)
        for key in [key for key in self._subscriptions if key[0] == role]:
            if key[1] not in wanted:
                self._stop(key)
        for url in wanted:
            if (role, url) not in self._subscriptions:
                subscription = Subscription(url, role, self.indexes[role], self)
                task = asyncio.create_task(subscription.run(), name=f"KV feed of {url}")
                self._subscriptions[(role, url)] = (subscription, task)

    def _stop(self, key: tuple[Role, str]) -> None:
        _, task = self._subscriptions.pop(key)
        task.cancel()
        self.indexes[key[0]].drop(key[1])
        self.weights.forget(key[1])

    def status(self, role: Role, url: str) -> KVFeedStatus | None:
        """The state of a worker's feed (None: not followed)."""
        found = self._subscriptions.get((role, url))
        return None if found is None else found[0].status

    def usable(self, role: Role, url: str) -> bool:
        """Whether the worker's blocks are in the index now."""
        status = self.status(role, url)
        return status is not None and status.state == "synced"

    def report(self) -> None:
        """Set the index and feed-state gauges (before a scrape)."""
        for role, index in self.indexes.items():
            self.metrics.set_index(role, index.entries, index.memory_bytes())
            states = Counter[str](
                subscription.status.state
                for (of_role, _), (subscription, _) in self._subscriptions.items()
                if of_role == role
            )
            self.metrics.set_states(role, dict(states))

    async def stop(self) -> None:
        """Stop following every feed."""
        tasks = [task for _, task in self._subscriptions.values()]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        self._subscriptions.clear()
