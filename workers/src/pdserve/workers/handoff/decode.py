"""The decode worker's side of the hand-off: it drives the whole exchange.

For a request that names a prefill worker, the decode worker reserves blocks for the
prompt under a lease (waiting, when its cache is full, for the requests decoding here
to free enough blocks), asks the prefill worker to compute the prompt into them, waits
for the data, checks the answer against what it asked for, then adopts the blocks
and decodes on as if it had prefilled the prompt itself. If any step fails, the
pool's policy decides: prefill here after all (`recompute`), or end the request with
the reason (`fail`). A bad peer costs one request, never the engine. A prompt whose
prefix this worker's cache holds but for at most the tokens the router says the pool
serves colocated is computed here instead: it costs a step's share here, where the
prefill worker, lacking that prefix, would compute the whole prompt behind its queue.

Blocks a peer may still be writing into are never freed early. A hand-off that
ends without adoption (failure, the client gone, the lease run out) releases its
blocks only once the write has provably stopped: the prefill worker answered, or
acknowledged a cancel (`/pd/cancel`), and the agent's receive is over. A peer that
never says so keeps them until the lease plus a margin has passed; the prefill
worker's own deadline ends its write well before that.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from pdserve.protocol.api_errors import validation_message
from pdserve.protocol.sampling import InvalidRequestError, SamplingParams
from pdserve.workers.engine.async_engine import AsyncEngine
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.kv_cache import BlockHash
from pdserve.workers.engine.leases import LeaseError, Reservation
from pdserve.workers.engine.logprobs import PromptLogprobs
from pdserve.workers.engine.sampler import Sampled
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.handoff.answers import drawn_inconsistencies
from pdserve.workers.handoff.blocking import BlockingCalls
from pdserve.workers.handoff.errors import HandoffError
from pdserve.workers.handoff.observer import HandoffObserver
from pdserve.workers.handoff.peer_http import NoReply, Reply, post_json
from pdserve.workers.handoff.peers import PrefillPeers
from pdserve.workers.handoff.protocol import (
    CancelAnswer,
    CancelRequest,
    PrefillAnswer,
    PrefillRequest,
    WireSampling,
)
from pdserve.workers.kv_transfer.base import (
    KVTransferAgent,
    NotConnectedError,
    PendingReceive,
    TransferError,
    TransferStats,
)

log = logging.getLogger(__name__)

POLICIES = ("recompute", "fail")
# How long past its lease a reservation nobody confirmed as safe stays allocated:
# the prefill worker writes within a share of the lease, counted from when it got
# the request; the margin covers that request's time on the way and more.
MIN_RELEASE_MARGIN_S = 5.0
RELEASE_MARGIN_SHARE = 0.5


# How often a hand-off waiting for free blocks to reserve tries again (about a decode
# step: blocks come free when a step ends a request).
ROOM_POLL_S = 0.01


def release_margin(lease_s: float) -> float:
    """Seconds past the lease before unconfirmed blocks are freed anyway."""
    return max(MIN_RELEASE_MARGIN_S, RELEASE_MARGIN_SHARE * lease_s)


@dataclass(frozen=True)
class _Attempt:
    """One hand-off under way: where, over which pair, into which blocks."""

    url: str
    pair: str
    reservation: Reservation
    prompt: list[int]
    params: SamplingParams

    @property
    def last_chance(self) -> float:
        """When settling must be done: a little before the lease book frees the
        blocks on its own."""
        hold_until = self.reservation.hold_until
        return hold_until - min(0.5, (hold_until - self.reservation.deadline) / 4)


class DecodeHandoff:
    """Runs requests whose prompt a prefill worker computes. A hand-off whose prompt
    finds too few free blocks here waits up to `room_wait_s` for running requests to
    free them before the failure `policy` applies."""

    def __init__(
        self,
        engine: AsyncEngine,
        agent: KVTransferAgent,
        metrics: HandoffObserver,
        policy: str = "recompute",
        lease_s: float = 30.0,
        headers: dict[str, str] | None = None,
        room_wait_s: float = 0.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown transfer failure policy {policy!r}; known: {POLICIES}")
        if not (lease_s > 0 and math.isfinite(lease_s)):
            raise ValueError(
                f"the hand-off lease must be a positive number of seconds, not {lease_s}"
            )
        if not (room_wait_s >= 0 and math.isfinite(room_wait_s)):
            raise ValueError(
                f"the wait for KV room must be a finite number of seconds >= 0, not {room_wait_s}"
            )
        self.engine = engine
        self.agent = agent
        self.metrics = metrics
        self.policy = policy
        self.lease_s = lease_s
        self.margin_s = release_margin(lease_s)
        self.room_wait_s = room_wait_s
        self.calls = BlockingCalls()
        self.peers = PrefillPeers(agent, self.calls)
        self.vocab = engine.engine.model_config.vocab_size
        self.headers = headers or {}  # sent to prefill workers: the pool's credential
        self._session: aiohttp.ClientSession | None = None
        self._settling: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop settling hand-offs, close the HTTP session and the threads."""
        for task in list(self._settling):
            task.cancel()
        await asyncio.gather(*self._settling, return_exceptions=True)
        await self.peers.close()
        if self._session is not None:
            await self._session.close()
        self.calls.close()

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        prefill_url: str,
        served_here: Callable[[str], None] = lambda why: None,
        local_tokens: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, its prompt prefilled by the worker at `prefill_url`,
        or here when this worker's prefix cache leaves at most `local_tokens` of it to
        compute. Raises HandoffError under the `fail` policy; calls `served_here` with
        why (`cached`, or `failed` when the hand-off failed) when the prompt is
        prefilled here instead."""
        started = time.monotonic()
        try:
            outputs = await self._handed_off(
                request_id, list(prompt), params, prefill_url, local_tokens
            )
        except CachedHere:
            self.metrics.observe_handoff_skipped()
            why = "cached"
        except HandoffError as error:
            self.metrics.observe_transfer_failure(error.code)
            if self.policy == "fail":
                raise
            log.warning("hand-off of %s failed (%s); prefilling here", request_id, error)
            why = "failed"
        else:
            self.metrics.observe_kv_wait(time.monotonic() - started)
            try:
                async for output in outputs:
                    yield output
            finally:
                await outputs.aclose()
            return
        served_here(why)
        async for output in self.engine.generate(prompt, params, request_id):
            yield output

    async def _handed_off(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        url: str,
        local_tokens: int,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of the request once its KV is adopted, the first one taken."""
        # The engine's id of this hand-off: unique, whatever id the client gave.
        transfer_id = f"{request_id[:64]}.kv-{uuid.uuid4().hex[:16]}"
        room = RoomWait(transfer_id, prompt, params, self.lease_s, self.margin_s, local_tokens)
        drawn, prompt_logprobs = await self._prefill_remotely(room, url)
        outputs = self.engine.stream(
            transfer_id, lambda engine: engine.adopt(transfer_id, drawn, prompt_logprobs)
        )
        try:
            first = await anext(outputs)
        except LeaseError as error:  # adopt freed the blocks (the write is over)
            raise HandoffError(
                "the lease ran out before the KV was adopted", "lease_expired"
            ) from error
        except InvalidRequestError as error:
            raise HandoffError(
                f"{url} answered a hand-off this worker refuses: {error}", "bad_handoff"
            ) from error
        return _chain(first, outputs)

    async def _prefill_remotely(
        self, room: RoomWait, url: str
    ) -> tuple[Sampled, PromptLogprobs | None]:
        """Have the prefill worker at `url` write the prompt's KV into blocks `room`
        reserves (once, whatever n); the first token of each choice with the
        log-probabilities asked for. On failure the blocks are released once that is
        safe. CachedHere when this worker holds the prompt but what it may compute."""
        transfer_id, prompt, params = room.transfer_id, room.prompt, room.params
        session = self._http()
        # Looked up before the prefill worker is met (a first contact waits for its
        # answer): a prompt computed here never waits on that worker. Without a bound
        # nothing is computed here, and the engine thread is not asked.
        if room.local_tokens > 0 and await self.engine.call(room.is_local):
            raise CachedHere(transfer_id)
        pair = await self.peers.hold(session, url, time.monotonic() + self.lease_s)
        try:
            reservation = await self._reserve(room)
        except BaseException:
            self.peers.let_go(url)
            raise
        if reservation is None:
            self.peers.let_go(url)
            raise HandoffError("no free KV blocks to reserve for the prompt", "no_blocks")
        try:
            pair, pending = await self._expect(session, url, pair, reservation)
        except BaseException:  # nothing was posted
            self.engine.abort(transfer_id)
            raise
        attempt = _Attempt(url, pair, reservation, prompt, params)
        asking = asyncio.ensure_future(self._ask_prefill(session, attempt))
        try:
            reply = await asyncio.shield(asking)
            drawn = self._accept(reply, attempt)
            await self.calls.move(reservation.deadline, pending.wait)
        except BaseException as error:
            self._settle_later(attempt, asking, pending)
            failure = _failure(error, attempt, self.peers)
            if failure is error:
                raise
            raise failure from error
        self.peers.let_go(url)
        self.metrics.observe_peers(self.agent.num_peers())
        layout, reused = self.agent.layout, reservation.first_block
        self.metrics.observe_kv_reused(reused, reused * layout.num_layers * layout.block_bytes)
        return drawn

    async def _reserve(self, room: RoomWait) -> Reservation | None:
        """Blocks for the prompt under a lease: at once, or as soon as the requests
        decoding here free enough of them, within `room_wait_s` (None after that, or at
        once for a prompt larger than the whole cache). A cache full of running
        requests frees blocks as their answers end; prefilling the prompt here instead
        would need the same blocks, compute it beside those answers' steps, and preempt
        them when blocks ran short. CachedHere once the cache holds all of the prompt
        but what the worker may compute itself."""
        started = time.monotonic()
        while True:
            try:
                reservation = await self.engine.call(room.try_reserve)
            except BaseException:  # e.g. the client left: a try the engine still makes
                self.engine.abort(room.transfer_id)  # must not keep blocks for a lease
                raise
            if room.local:
                raise CachedHere(room.transfer_id)
            waited = time.monotonic() - started
            if reservation is not None:
                if room.attempts > 1:
                    self.metrics.observe_room_wait(waited)
                return reservation
            if room.never or waited >= self.room_wait_s:
                return None
            await asyncio.sleep(ROOM_POLL_S)

    async def _expect(
        self, session: aiohttp.ClientSession, url: str, pair: str, reservation: Reservation
    ) -> tuple[str, PendingReceive]:
        """Get the agent ready to receive into the reserved blocks; the pair held then.
        A pair dropped here since it was met (a receive that timed out) is met again,
        once."""
        blocks, transfer_id = reservation.block_ids, reservation.request_id
        try:
            return pair, self.agent.expect(pair, blocks, transfer_id)
        except NotConnectedError:
            self.peers.forget(url, pair)
            self.peers.let_go(url)
        except (TransferError, ValueError) as error:
            raise self._broken(url, pair, error) from error
        pair = await self.peers.hold(session, url, reservation.deadline)
        try:
            return pair, self.agent.expect(pair, blocks, transfer_id)
        except (TransferError, ValueError) as error:
            raise self._broken(url, pair, error) from error

    def _broken(self, url: str, pair: str, error: Exception) -> HandoffError:
        """Let go of a pair that cannot take a transfer, to be met again next time."""
        self.peers.forget(url, pair)
        self.peers.let_go(url)
        return HandoffError(f"KV transfer failed: {error}", "transfer_failed")

    async def _ask_prefill(self, session: aiohttp.ClientSession, attempt: _Attempt) -> Reply:
        reservation = attempt.reservation
        left = reservation.deadline - time.monotonic()
        body = PrefillRequest(
            peer=attempt.pair,
            request_id=reservation.request_id,
            prompt_token_ids=attempt.prompt,
            sampling=WireSampling.of(attempt.params),
            block_ids=reservation.block_ids,
            first_block=reservation.first_block,
            lease_ms=max(1, int(left * 1000)),
        )
        return await post_json(
            session, f"{attempt.url}/pd/prefill", body.model_dump(), reservation.deadline
        )

    def _accept(self, reply: Reply, attempt: _Attempt) -> tuple[Sampled, PromptLogprobs | None]:
        """The first tokens of a prefill worker's answer and the log-probabilities,
        once every field checks out against what was asked (HandoffError otherwise)."""
        if not reply.ok:
            error = reply.error()
            if error.code == "unknown_peer":  # it forgot the pair: meet again next time
                self.peers.forget(attempt.url, attempt.pair)
            raise error
        try:
            answer = PrefillAnswer.model_validate(reply.body)
        except ValidationError as error:
            message = f"{attempt.url} answered a malformed hand-off: {validation_message(error)}"
            raise HandoffError(message, "bad_handoff") from error
        problems = self._inconsistencies(answer, attempt.reservation)
        problems += drawn_inconsistencies(answer, attempt.prompt, attempt.params, self.vocab)
        if problems:
            message = f"{attempt.url} answered an inconsistent hand-off: {'; '.join(problems)}"
            raise HandoffError(message, "bad_handoff")
        stats = TransferStats(answer.bytes, answer.transfer_seconds, answer.descriptors)
        self.metrics.observe_transfer(stats)
        return answer.drawn()

    def _inconsistencies(self, answer: PrefillAnswer, reservation: Reservation) -> list[str]:
        """What in a well-formed answer contradicts the hand-off asked for."""
        layout = self.agent.layout
        blocks = len(reservation.block_ids)
        copies = blocks * layout.num_layers  # most descriptors: one per block per layer
        problems = []
        if answer.blocks != blocks:
            problems.append(f"{answer.blocks} blocks written, {blocks} asked for")
        if answer.bytes != copies * layout.block_bytes:
            problems.append(f"{answer.bytes} bytes written, {copies * layout.block_bytes} expected")
        if not 0 < answer.descriptors <= copies:
            problems.append(f"{answer.descriptors} descriptors for {copies} block copies")
        if max(answer.transfer_seconds, answer.prefill_seconds) > self.lease_s:
            problems.append("durations longer than the lease")
        return problems

    # -- settling a hand-off that was not adopted ------------------------------

    def _settle_later(
        self, attempt: _Attempt, asking: asyncio.Future[Reply], pending: PendingReceive
    ) -> None:
        task = asyncio.ensure_future(self._settle(attempt, asking, pending))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(
        self, attempt: _Attempt, asking: asyncio.Future[Reply], pending: PendingReceive
    ) -> None:
        """Release the reserved blocks once nothing can land in them any more; leave
        them to the lease book (freed at the lease's end plus the margin) when that
        cannot be known."""
        request_id = attempt.reservation.request_id
        try:
            stopped = await self._writer_stopped(attempt, asking)
            withdrawn = await self.calls.move(attempt.last_chance, pending.withdraw)
            if stopped or withdrawn:
                await self.engine.call(lambda engine: engine.release(request_id))
            else:
                log.warning(
                    "hand-off %s: %s never confirmed that its write stopped; its blocks "
                    "stay reserved until the lease and margin are over", request_id, attempt.url,
                )  # fmt: skip
        except TransferError as error:
            log.warning("hand-off %s: could not withdraw its receive: %s", request_id, error)
        finally:
            self.peers.let_go(attempt.url)
            self.metrics.observe_peers(self.agent.num_peers())

    async def _writer_stopped(self, attempt: _Attempt, asking: asyncio.Future[Reply]) -> bool:
        """Whether the prefill worker's write provably stopped: it answered the
        hand-off (whatever the answer), or acknowledged a cancel, by the last chance."""
        if asking.done():
            return _answered(asking)
        cancelling = asyncio.ensure_future(self._cancel(attempt))
        waiting: set[asyncio.Future[Any]] = {asking, cancelling}
        try:
            while waiting:
                left = attempt.last_chance - time.monotonic()
                done, waiting = await asyncio.wait(
                    waiting, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    return False
                if (asking in done and _answered(asking)) or (
                    cancelling in done and cancelling.result()
                ):
                    return True
            return False
        finally:
            asking.cancel()
            cancelling.cancel()

    async def _cancel(self, attempt: _Attempt) -> bool:
        """Ask the prefill worker to stop; whether it says its write has stopped."""
        reservation = attempt.reservation
        body = CancelRequest(
            peer=attempt.pair, request_id=reservation.request_id, block_ids=reservation.block_ids
        )
        try:
            reply = await post_json(
                self._http(), f"{attempt.url}/pd/cancel", body.model_dump(), attempt.last_chance
            )
            return reply.ok and CancelAnswer.model_validate(reply.body).stopped
        except (NoReply, ValidationError) as error:
            log.info("cancel of %s at %s failed: %s", reservation.request_id, attempt.url, error)
            return False

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers)
        return self._session


class CachedHere(Exception):
    """The decode worker's prefix cache holds all of a prompt but the few tokens it
    computes itself: no hand-off is made."""


class RoomWait:
    """A hand-off's tries to reserve its prompt's blocks, on the engine thread (the
    plan's simulator makes the same ones): each looks again only once more blocks are
    free than at the last look (a reservation hashes the whole prompt), and a prompt
    larger than the whole cache stops them. Each try first looks up the prompt in the
    prefix cache: one that leaves at most `local_tokens` tokens to compute ends the
    tries (`local`), to be prefilled here."""

    def __init__(
        self,
        transfer_id: str,
        prompt: list[int],
        params: SamplingParams,
        lease_s: float,
        margin_s: float,
        local_tokens: int = 0,
    ) -> None:
        self.transfer_id = transfer_id
        self.prompt = prompt
        self.params = params
        self.lease_s = lease_s
        self.margin_s = margin_s
        self.local_tokens = local_tokens
        self.attempts = 0
        self.never = False
        self.local = False
        self._free_then = -1  # free blocks at the last try
        self._hashes: list[BlockHash] = []  # the prompt's first blocks', once computed

    def is_local(self, engine: LLMEngine) -> bool:
        """Whether this worker's prefix cache holds the prompt but at most
        `local_tokens` of it, to be prefilled here (`local`)."""
        if self.local_tokens > 0:
            cached = engine.kv_cache.cached_prefix_length(self.prompt, self._hashes)
            self.local = len(self.prompt) - cached <= self.local_tokens
        return self.local

    def try_reserve(self, engine: LLMEngine) -> Reservation | None:
        """Reserve if there may be room now; None if there is not, or if the prompt is
        to be prefilled here (`local`)."""
        kv_cache = engine.kv_cache
        if kv_cache.blocks_for(len(self.prompt)) > kv_cache.pool.num_blocks:
            self.never = True
            return None
        if self.is_local(engine):
            return None
        free = kv_cache.pool.num_free
        if free <= self._free_then:
            return None
        self._free_then = free
        self.attempts += 1
        return engine.reserve(
            self.transfer_id, self.prompt, self.params, self.lease_s, self.margin_s
        )


def _answered(asking: asyncio.Future[Reply]) -> bool:
    """Whether the prefill worker answered (it answers once its write has stopped)."""
    return asking.done() and not asking.cancelled() and asking.exception() is None


def _failure(error: BaseException, attempt: _Attempt, peers: PrefillPeers) -> BaseException:
    """What a failed hand-off raises: HandoffError, or the error itself (a
    cancellation; an error already a HandoffError)."""
    if isinstance(error, NoReply):
        code = "lease_expired" if error.timed_out else "prefill_failed"
        return HandoffError(str(error), code)
    if isinstance(error, TransferError):
        peers.forget(attempt.url, attempt.pair)  # the pair may be broken: meet again
        return HandoffError(f"KV transfer failed: {error}", "transfer_failed")
    return error


async def _chain(
    first: RequestOutput, rest: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    try:
        yield first
        async for output in rest:
            yield output
    finally:
        await rest.aclose()  # aborts the request if it had not finished
