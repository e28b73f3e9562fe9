"""The decode worker's connections to prefill workers, one pair per URL.

A pair is met once (`/pd/connect` beside the agent's `accept`) and used by every
hand-off to that prefill worker until it breaks. Every wait has an end: a hand-off
waits for a meeting under way no longer than its own deadline, and a failed meeting
is remembered for a short while, so the requests queued behind a dead prefill worker
fail together instead of each trying again for a whole timeout. The table is
bounded: beyond `max_peers` URLs, the least recently used idle one is dropped (its
agent connection closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import ValidationError

from pdserve.protocol.api_errors import validation_message
from pdserve.workers.handoff.blocking import BlockingCalls
from pdserve.workers.handoff.errors import HandoffError
from pdserve.workers.handoff.expiring import ExpiringMap
from pdserve.workers.handoff.peer_http import NoReply, get_json, post_json
from pdserve.workers.handoff.protocol import ConnectAnswer, ConnectRequest
from pdserve.workers.kv_transfer.base import KVTransferAgent, TransferError
from pdserve.workers.kv_transfer.layout import KVLayout, LayoutMismatchError

log = logging.getLogger(__name__)

MAX_PEERS = 64
FAILURE_MEMORY_S = 5.0


@dataclass
class _Peer:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pair: str | None = None
    users: int = 0  # hand-offs holding the pair now
    dropped: str | None = None  # the pair before, broken: the next meeting replaces it


class PrefillPeers:
    """Pairs of this decode worker's agent with prefill workers, by URL."""

    def __init__(
        self,
        agent: KVTransferAgent,
        calls: BlockingCalls,
        max_peers: int = MAX_PEERS,
        failure_memory_s: float = FAILURE_MEMORY_S,
    ) -> None:
        self.agent = agent
        self.calls = calls
        self.max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # LRU first
        self._failures: ExpiringMap[str, HandoffError] = ExpiringMap(failure_memory_s, 1024)
        self._background: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._peers)

    async def hold(self, session: aiohttp.ClientSession, url: str, deadline: float) -> str:
        """The pair id shared with the prefill worker at `url`, meeting it first if
        needed (by `deadline`); the caller holds it until `let_go(url)`. Raises
        HandoffError."""
        peer = self._peers.get(url) or self._add(url)
        self._peers.move_to_end(url)
        peer.users += 1
        try:
            if peer.pair is None:
                await self._meet(session, url, peer, deadline)
            assert peer.pair is not None
            return peer.pair
        except BaseException:
            self.let_go(url)
            raise

    def let_go(self, url: str) -> None:
        """A hand-off that held `url`'s pair is over."""
        peer = self._peers.get(url)
        if peer is not None:
            peer.users -= 1
        self._evict()

    def forget(self, url: str, pair: str) -> None:
        """Drop a pair that broke (if it is still `url`'s): the next hand-off meets
        again, and the agent closes its end."""
        peer = self._peers.get(url)
        if peer is not None and peer.pair == pair:
            peer.pair, peer.dropped = None, pair
        self._disconnect(pair)

    async def close(self) -> None:
        """Wait for disconnections under way."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _add(self, url: str) -> _Peer:
        peer = _Peer()
        self._peers[url] = peer
        return peer

    def _evict(self) -> None:
        idle = [
            url for url, peer in self._peers.items() if not peer.users and not peer.lock.locked()
        ]
        for url in idle[: max(0, len(self._peers) - self.max_peers)]:
            pair = self._peers.pop(url).pair
            if pair is not None:
                self._disconnect(pair)

    async def _meet(
        self, session: aiohttp.ClientSession, url: str, peer: _Peer, deadline: float
    ) -> None:
        self._raise_remembered(url)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await peer.lock.acquire()
        except TimeoutError:
            raise HandoffError(
                f"timed out waiting for the connection to {url} under way", "connect_failed"
            ) from None
        try:
            if peer.pair is None:
                self._raise_remembered(url)  # it failed while this one waited
                try:
                    peer.pair = await self._connect(session, url, deadline, peer.dropped)
                    peer.dropped = None
                except HandoffError as error:
                    self._failures.put(url, error)
                    raise
        finally:
            peer.lock.release()

    def _raise_remembered(self, url: str) -> None:
        failed = self._failures.get(url)
        if failed is not None:
            raise HandoffError(f"{failed} (a moment ago; not tried again yet)", failed.code)

    async def _connect(
        self, session: aiohttp.ClientSession, url: str, deadline: float, replaces: str | None
    ) -> str:
        # A peer that is not up and answering costs no thread: the agent's side of
        # the meeting (which may block for the whole deadline) starts only after.
        try:
            ready = await get_json(session, f"{url}/ready", deadline)
        except NoReply as error:
            raise HandoffError(f"could not connect to {url}: {error}", "connect_failed") from error
        if not ready.ok:
            raise HandoffError(f"{url} is not ready (HTTP {ready.status})", "connect_failed")
        pair = uuid.uuid4().hex
        # The agent's side of the meeting may block until the peer joins, so it runs
        # beside the request that makes the peer join.
        accepting = asyncio.ensure_future(
            self.calls.meet(deadline, lambda timeout_s: self.agent.accept(pair, timeout_s))
        )
        metadata = self.agent.metadata()
        body = ConnectRequest(peer=pair, metadata=metadata, replaces=replaces).model_dump()
        try:
            reply = await post_json(session, f"{url}/pd/connect", body, deadline)
            if not reply.ok:
                raise reply.error()
            answer = ConnectAnswer.model_validate(reply.body)
            peer_layout = KVLayout.from_json(answer.metadata.get("layout"))
            self.agent.layout.check_compatible(
                peer_layout, local="the decode worker", remote="the prefill worker"
            )
            await accepting
        except BaseException as error:
            # A meeting that failed leaves no half of a pair behind, once the
            # agent's side (which cannot be interrupted) is over.
            self._spawn(self._discard(accepting, pair))
            failure = _connect_error(url, error)
            if failure is error:
                raise
            raise failure from error
        log.info("connected to prefill worker %s (pair %s)", url, pair)
        return pair

    async def _discard(self, accepting: asyncio.Future[None], pair: str) -> None:
        # The meeting's failure was reported; only its leftovers remain.
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await accepting
        await self._quietly_disconnect(pair)

    def _disconnect(self, pair: str) -> None:
        self._spawn(self._quietly_disconnect(pair))

    async def _quietly_disconnect(self, pair: str) -> None:
        deadline = time.monotonic() + 60.0  # closing a connection never waits on a peer
        try:
            await self.calls.meet(deadline, lambda _: self.agent.disconnect(pair))
        except TransferError as error:
            log.warning("could not close pair %s: %s", pair, error)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _connect_error(url: str, error: BaseException) -> BaseException:
    """What a failed meeting raises: HandoffError with the cause's code, or the
    error itself (a cancellation)."""
    if isinstance(error, HandoffError):
        code = error.code if error.code in {"layout_mismatch", "unknown_peer"} else "connect_failed"
        return HandoffError(f"could not connect to {url}: {error}", code)
    if isinstance(error, LayoutMismatchError):
        return HandoffError(str(error), "layout_mismatch")
    if isinstance(error, ValidationError):
        message = f"{url} answered a malformed connection: {validation_message(error)}"
        return HandoffError(message, "connect_failed")
    if isinstance(error, (NoReply, TransferError, ValueError)):
        return HandoffError(f"could not connect to {url}: {error}", "connect_failed")
    return error
