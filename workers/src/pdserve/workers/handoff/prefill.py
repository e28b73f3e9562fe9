"""The prefill worker's side of the hand-off: `/pd/connect` and `/pd/prefill`.

A prefill runs as an ordinary request of one token under this worker's own token
budget (chunked), keeping its KV blocks when it finishes; the blocks are then
written into the decode worker's reserved blocks and released. They are released
whatever happens: written, failed, past the deadline, or the decode worker gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web

from pdserve.workers import faults
from pdserve.workers.api_errors import APIError, read_body
from pdserve.workers.engine.async_engine import AsyncEngine
from pdserve.workers.engine.sampling import InvalidRequestError
from pdserve.workers.handoff.observer import HandoffObserver
from pdserve.workers.handoff.protocol import (
    ConnectAnswer,
    ConnectRequest,
    PrefillAnswer,
    PrefillRequest,
)
from pdserve.workers.kv_transfer.base import KVTransferAgent, TransferError, TransferStats
from pdserve.workers.kv_transfer.layout import LayoutMismatchError

log = logging.getLogger(__name__)

# Share of the decode worker's lease this side may use: the write must land well
# before the decode worker gives up and reuses its blocks.
LEASE_SHARE = 0.8


class PrefillService:
    """Serves hand-offs for decode workers."""

    def __init__(
        self,
        engine: AsyncEngine,
        agent: KVTransferAgent,
        metrics: HandoffObserver,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.agent = agent
        self.metrics = metrics
        self.connect_timeout_s = connect_timeout_s
        self._peers: set[str] = set()

    def add_routes(self, app: web.Application) -> None:
        """Mount the hand-off endpoints."""
        app.router.add_post("/pd/connect", self.connect)
        app.router.add_post("/pd/prefill", self.prefill)

    async def connect(self, request: web.Request) -> web.Response:
        """POST /pd/connect: meet a decode worker's transfer agent."""
        body = await read_body(request, ConnectRequest, "hand-off")
        try:
            await asyncio.to_thread(
                self.agent.connect, body.peer, body.metadata, self.connect_timeout_s
            )
        except LayoutMismatchError as error:
            raise _refused(409, f"refused: {error}", "layout_mismatch") from error
        except (TransferError, ValueError, KeyError) as error:
            message = f"could not connect to the decode worker: {error}"
            raise _refused(502, message, "connect_failed") from error
        self._peers.add(body.peer)
        return web.json_response(ConnectAnswer(metadata=self.agent.metadata()).model_dump())

    async def prefill(self, request: web.Request) -> web.Response:
        """POST /pd/prefill: compute a prompt and write its KV into the decode
        worker's blocks; answer with the first token once the write is complete."""
        received = time.monotonic()
        body = await read_body(request, PrefillRequest, "hand-off")
        deadline = received + LEASE_SHARE * body.lease_ms / 1000
        self._check(body)
        request_id = f"handoff-{uuid.uuid4().hex}"
        writing: asyncio.Future[TransferStats] | None = None
        try:
            first_token = await self._first_token(request_id, body)
            await faults.point("prefill.before_write")
            blocks = await self.engine.call(lambda engine: engine.held_blocks(request_id))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.observe_transfer_failure("lease_expired")
                message = "the decode worker's lease ran out before the write"
                raise _refused(410, message, "lease_expired")
            writing = asyncio.ensure_future(
                asyncio.to_thread(
                    self.agent.write, body.peer, blocks[body.first_block :], body.block_ids,
                    body.request_id, remaining,
                )
            )  # fmt: skip
            # The blocks are released only once the write has stopped touching them.
            writing.add_done_callback(lambda _: self.engine.abort(request_id))
            stats = await asyncio.shield(writing)
        except InvalidRequestError as error:
            raise _refused(400, str(error), "bad_handoff") from error
        except TransferError as error:
            self.metrics.observe_transfer_failure("transfer_failed")
            raise _refused(502, f"KV transfer failed: {error}", "transfer_failed") from error
        finally:
            if writing is None:
                self.engine.abort(request_id)
        self.metrics.observe_transfer(stats)
        answer = PrefillAnswer(
            first_token=first_token,
            bytes=stats.bytes,
            transfer_seconds=stats.seconds,
            descriptors=stats.descriptors,
            prefill_seconds=time.monotonic() - received,
        )
        return web.json_response(answer.model_dump())

    def _check(self, body: PrefillRequest) -> None:
        """Refuse (4xx) a hand-off that cannot be right."""
        if body.peer not in self._peers:
            raise _refused(400, f"unknown decode peer {body.peer!r}: connect first", "unknown_peer")
        block_size = self.engine.engine.block_size
        needed = -(-len(body.prompt_token_ids) // block_size) - body.first_block
        if len(body.block_ids) != needed:
            message = (
                f"the hand-off names {len(body.block_ids)} blocks from block "
                f"{body.first_block}; a prompt of {len(body.prompt_token_ids)} tokens in "
                f"blocks of {block_size} needs {needed}"
            )
            raise _refused(400, message, "bad_handoff")

    async def _first_token(self, request_id: str, body: PrefillRequest) -> int:
        params = body.sampling.first_token_params()
        tokens: list[int] = []
        outputs = self.engine.generate(body.prompt_token_ids, params, request_id, hold_blocks=True)
        async for output in outputs:
            tokens.extend(output.new_token_ids)
        return tokens[0]


def _refused(status: int, message: str, code: str) -> APIError:
    log.warning("hand-off refused (%s): %s", code, message)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return APIError(status, message, kind, code)
