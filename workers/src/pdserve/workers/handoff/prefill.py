"""The prefill worker's side of the hand-off: `/pd/connect`, `/pd/prefill` and
`/pd/cancel`.

A prefill runs as an ordinary request of one token (one per choice for n > 1, none
when only the prompt's log-probabilities are asked for) under this worker's own
token budget (chunked), keeping its KV blocks when it finishes; the blocks are then
written into the decode worker's reserved blocks and released. They are released
whatever happens: written, failed, past the deadline, cancelled, or the decode
worker gone, and only once the write has stopped reading them.

The write's deadline is this worker's own: a share of the lease the decode worker
has left, and never more than `--handoff-timeout`. Every answer to `/pd/prefill`
is sent once the write has stopped, so the decode worker may free its blocks on
any answer. A hand-off the decode worker withdraws (`/pd/cancel`) stops as soon as
it can: before the write, it never writes; during a NIXL write, the write is
aborted; the cancel is answered once nothing more of it can land. A transfer that
will not write completes the receives the decode worker posted for it (`decline`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from pdserve.protocol.api_errors import APIError, read_body
from pdserve.protocol.sampling import InvalidRequestError
from pdserve.workers import faults
from pdserve.workers.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.workers.engine.isolation import RequestFailedError
from pdserve.workers.engine.leases import LeaseError
from pdserve.workers.engine.logprobs import PromptLogprobs, TokenLogprob
from pdserve.workers.engine.sampler import Sampled
from pdserve.workers.handoff.blocking import BlockingCalls
from pdserve.workers.handoff.expiring import ExpiringMap
from pdserve.workers.handoff.observer import HandoffObserver
from pdserve.workers.handoff.protocol import (
    CancelAnswer,
    CancelRequest,
    ConnectAnswer,
    ConnectRequest,
    PrefillAnswer,
    PrefillRequest,
    WireLogprob,
    wire_prompt_logprobs,
)
from pdserve.workers.kv_transfer.base import (
    KVTransferAgent,
    NotConnectedError,
    TransferError,
    TransferStats,
)
from pdserve.workers.kv_transfer.layout import LayoutMismatchError

log = logging.getLogger(__name__)

# Share of the decode worker's remaining lease this side may use: the write must
# land well before the decode worker gives up on its blocks.
LEASE_SHARE = 0.8
# Time to complete a decode worker's receives with filler (torch).
DECLINE_TIMEOUT_S = 2.0
# Hand-offs that ended or were cancelled are remembered this long (at least), so that
# a late cancel is answered right and a request cancelled before it came is refused.
ENDED_MEMORY_S = 60.0
MAX_ENDED = 65536

Key = tuple[str, str]  # (pair id, the decode worker's transfer id)
# What the prefill drew (a token per choice) and the prompt's log-probabilities.
Drawn = tuple[Sampled, PromptLogprobs | None]


@dataclass
class _Transfer:
    """One hand-off being served."""

    body: PrefillRequest
    received: float
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    computing: asyncio.Task[Drawn] | None = None

    @property
    def key(self) -> Key:
        return (self.body.peer, self.body.request_id)

    def cancel(self) -> None:
        """Stop as soon as possible: no write if none began, abort a NIXL write."""
        self.cancelled.set()
        if self.computing is not None:
            self.computing.cancel()


class PrefillService:
    """Serves hand-offs for decode workers."""

    def __init__(
        self,
        engine: AsyncEngine,
        agent: KVTransferAgent,
        metrics: HandoffObserver,
        timeout_s: float = 30.0,
    ) -> None:
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(
                f"the hand-off timeout must be a positive number of seconds, not {timeout_s}"
            )
        self.engine = engine
        self.agent = agent
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.calls = BlockingCalls()
        self._live: dict[Key, _Transfer] = {}
        self._ended: ExpiringMap[Key, bool] = ExpiringMap(
            max(ENDED_MEMORY_S, 4 * timeout_s), MAX_ENDED
        )

    def add_routes(self, app: web.Application) -> None:
        """Mount the hand-off endpoints."""
        app.router.add_post("/pd/connect", self.connect)
        app.router.add_post("/pd/prefill", self.prefill)
        app.router.add_post("/pd/cancel", self.cancel)

    def close(self) -> None:
        """Stop the transfer threads (running calls finish on their own)."""
        self.calls.close()

    async def connect(self, request: web.Request) -> web.Response:
        """POST /pd/connect: meet a decode worker's transfer agent."""
        body = await read_body(request, ConnectRequest, "hand-off")
        deadline = time.monotonic() + self.timeout_s

        def meet(left: float) -> None:
            self.agent.connect(body.peer, body.metadata, left)
            if body.replaces is not None:  # the decode worker dropped it: so do we
                self.agent.disconnect(body.replaces)

        try:
            await self.calls.meet(deadline, meet)
        except LayoutMismatchError as error:
            raise _refused(409, f"refused: {error}", "layout_mismatch") from error
        except (TransferError, ValueError, KeyError) as error:
            message = f"could not connect to the decode worker: {error}"
            raise _refused(502, message, "connect_failed") from error
        finally:
            self.metrics.observe_peers(self.agent.num_peers())
        return web.json_response(ConnectAnswer(metadata=self.agent.metadata()).model_dump())

    async def prefill(self, request: web.Request) -> web.Response:
        """POST /pd/prefill: compute a prompt and write its KV into the decode
        worker's blocks; answer with the first token once the write is complete."""
        received = time.monotonic()
        body = await read_body(request, PrefillRequest, "hand-off")
        budget = min(LEASE_SHARE * body.lease_ms / 1000, self.timeout_s)
        transfer = self._start(_Transfer(body, received, received + budget))
        serving = asyncio.ensure_future(self._serve(transfer))
        serving.add_done_callback(_retrieve)
        try:
            answer = await asyncio.shield(serving)
        except asyncio.CancelledError:
            transfer.cancel()  # the decode worker hung up: stop, decline, release
            raise
        return web.json_response(answer.model_dump())

    async def cancel(self, request: web.Request) -> web.Response:
        """POST /pd/cancel: withdraw a hand-off; answers once nothing more of its
        write can land in the decode worker's blocks (`stopped`), or, if that does
        not come in time, says so."""
        body = await read_body(request, CancelRequest, "hand-off")
        key = (body.peer, body.request_id)
        transfer = self._live.get(key)
        if transfer is not None:
            transfer.cancel()
            left = transfer.deadline - time.monotonic() + DECLINE_TIMEOUT_S + 1.0
            try:
                await asyncio.wait_for(transfer.stopped.wait(), max(0.0, left))
            except TimeoutError:
                return _cancel_answer(stopped=False)
            return _cancel_answer(stopped=True)
        if key not in self._ended:
            # Not come yet: refused when it comes; the receives the decode worker
            # posted for it are completed now.
            self._ended.put(key, True)
            await self._decline(body.peer, body.block_ids, body.request_id)
        return _cancel_answer(stopped=True)

    def _start(self, transfer: _Transfer) -> _Transfer:
        """Register a hand-off; 4xx when it cannot be served."""
        body, key = transfer.body, transfer.key
        if not self.agent.is_connected(body.peer):
            raise _refused(400, f"unknown decode peer {body.peer!r}: connect first", "unknown_peer")
        if key in self._ended:
            message = f"hand-off {body.request_id!r} was cancelled, or has ended"
            raise _refused(409, message, "cancelled")
        if key in self._live:
            raise _refused(409, f"hand-off {body.request_id!r} is already under way", "bad_handoff")
        self._live[key] = transfer
        return transfer

    def _end(self, transfer: _Transfer) -> None:
        """The hand-off's write has stopped for good."""
        self._live.pop(transfer.key, None)
        self._ended.put(transfer.key, True)
        transfer.stopped.set()

    async def _serve(self, transfer: _Transfer) -> PrefillAnswer:
        """Compute, write, answer; the blocks are released once the write stopped."""
        body = transfer.body
        request_id = f"handoff-{uuid.uuid4().hex}"
        writing: asyncio.Future[TransferStats] | None = None
        try:
            self._check(body)
            transfer.computing = asyncio.ensure_future(self._first_draw(request_id, body))
            drawn, prompt_logprobs = await transfer.computing
            self._check_going(transfer)
            blocks = await self.engine.call(lambda engine: engine.held_blocks(request_id))
            writing = asyncio.ensure_future(
                self.calls.move(
                    transfer.deadline,
                    lambda left: self.agent.write(
                        body.peer, blocks[body.first_block :], body.block_ids,
                        body.request_id, left, transfer.cancelled,
                    ),
                )
            )  # fmt: skip
            # The blocks are released only once the write has stopped touching them.
            writing.add_done_callback(lambda _: self._wrote(transfer, request_id))
            stats = await asyncio.shield(writing)
        except asyncio.CancelledError as error:
            if not transfer.cancelled.is_set():
                raise
            raise _refused(409, "the decode worker cancelled this hand-off", "cancelled") from error
        except InvalidRequestError as error:
            raise _refused(400, str(error), "bad_handoff") from error
        except LeaseError as error:
            raise _refused(
                410, f"the prompt's blocks are gone: {error}", "lease_expired"
            ) from error
        except EngineDeadError as error:
            raise _refused(503, str(error), "prefill_failed") from error
        except RequestFailedError as error:
            status, code = (400, "bad_handoff") if error.invalid else (500, "prefill_failed")
            raise _refused(status, str(error), code) from error
        except NotConnectedError as error:
            raise _refused(400, str(error), "unknown_peer") from error
        except TransferError as error:
            if transfer.cancelled.is_set():
                raise _refused(409, f"cancelled: {error}", "cancelled") from error
            self.metrics.observe_transfer_failure("transfer_failed")
            raise _refused(502, f"KV transfer failed: {error}", "transfer_failed") from error
        finally:
            if writing is None:
                self.engine.abort(request_id)
                await self._decline(body.peer, body.block_ids, body.request_id)
                self._end(transfer)
        self.metrics.observe_transfer(stats)
        logprobs = drawn.logprobs
        return PrefillAnswer(
            first_tokens=drawn.tokens,
            logprobs=None if logprobs is None else [WireLogprob.of(e) for e in logprobs],
            prompt_logprobs=wire_prompt_logprobs(prompt_logprobs),
            blocks=len(body.block_ids),
            bytes=stats.bytes,
            transfer_seconds=stats.seconds,
            descriptors=stats.descriptors,
            prefill_seconds=time.monotonic() - transfer.received,
        )

    def _wrote(self, transfer: _Transfer, request_id: str) -> None:
        self.engine.abort(request_id)
        self._end(transfer)

    def _check(self, body: PrefillRequest) -> None:
        """Refuse (4xx) a hand-off that cannot be right."""
        block_size = self.engine.engine.block_size
        needed = -(-len(body.prompt_token_ids) // block_size) - body.first_block
        if len(body.block_ids) != needed:
            message = (
                f"the hand-off names {len(body.block_ids)} blocks from block "
                f"{body.first_block}; a prompt of {len(body.prompt_token_ids)} tokens in "
                f"blocks of {block_size} needs {needed}"
            )
            raise _refused(400, message, "bad_handoff")

    def _check_going(self, transfer: _Transfer) -> None:
        """Refuse to begin a write that was cancelled or is out of time."""
        if transfer.cancelled.is_set():
            raise _refused(409, "the decode worker cancelled this hand-off", "cancelled")
        if time.monotonic() >= transfer.deadline:
            self.metrics.observe_transfer_failure("lease_expired")
            message = "the hand-off's deadline passed before the write began"
            raise _refused(410, message, "lease_expired")

    async def _first_draw(self, request_id: str, body: PrefillRequest) -> Drawn:
        """Compute the prompt (keeping its blocks) and draw its first token, one per
        choice; with the log-probabilities asked for."""
        params = body.sampling.first_token_params()
        tokens: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        prompt: PromptLogprobs | None = None
        outputs = self.engine.generate(body.prompt_token_ids, params, request_id, hold_blocks=True)
        async for output in outputs:
            for token in output.new_token_ids:
                tokens[output.index] = token
            for entry in output.logprobs or ():
                logprobs[output.index] = entry
            prompt = output.prompt_logprobs or prompt
        choices = list(range(params.n)) if body.sampling.sample else []
        if sorted(tokens) != choices:
            raise _refused(503, "the prefill ended without its tokens", "prefill_failed")
        await faults.point("prefill.before_write")
        drawn = [logprobs[index] for index in choices] if params.logprobs is not None else None
        return Sampled([tokens[index] for index in choices], drawn), prompt

    async def _decline(self, peer: str, block_ids: list[int], transfer_id: str) -> None:
        """Complete the receives the decode worker posted for a transfer that will not
        write (torch); a failure drops the pair, which ends them as well."""
        if not self.agent.is_connected(peer):
            return
        deadline = time.monotonic() + DECLINE_TIMEOUT_S
        try:
            await self.calls.move(
                deadline, lambda left: self.agent.decline(peer, block_ids, transfer_id, left)
            )
        except TransferError as error:
            log.warning("could not decline transfer %s to %s: %s", transfer_id, peer, error)


def _cancel_answer(stopped: bool) -> web.Response:
    return web.json_response(CancelAnswer(stopped=stopped).model_dump())


def _retrieve(task: asyncio.Future[PrefillAnswer]) -> None:
    """Consume the outcome of a hand-off whose requester may have left."""
    if not task.cancelled():
        task.exception()


def _refused(status: int, message: str, code: str) -> APIError:
    log.warning("hand-off refused (%s): %s", code, message)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return APIError(status, message, kind, code)
