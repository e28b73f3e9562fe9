"""The decode worker's side of the hand-off: it drives the whole exchange.

For a request that names a prefill worker, the decode worker reserves blocks for the
prompt under a lease, asks the prefill worker to compute the prompt into them, waits
for the data, then adopts the blocks and decodes on as if it had prefilled the prompt
itself. If any step fails, the reservation is released and the pool's policy
decides: prefill here after all (`recompute`), or end the request with the reason
(`fail`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import aiohttp

from pdserve.workers.engine.async_engine import Admit, AsyncEngine
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.leases import Reservation
from pdserve.workers.engine.sampler import Sampled
from pdserve.workers.engine.sampling import SamplingParams
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.handoff.errors import HandoffError
from pdserve.workers.handoff.observer import HandoffObserver
from pdserve.workers.handoff.protocol import (
    ConnectAnswer,
    ConnectRequest,
    PrefillAnswer,
    PrefillRequest,
    WireSampling,
)
from pdserve.workers.kv_transfer.base import (
    KVTransferAgent,
    PendingReceive,
    TransferError,
    TransferStats,
)
from pdserve.workers.kv_transfer.layout import KVLayout, LayoutMismatchError

log = logging.getLogger(__name__)

POLICIES = ("recompute", "fail")


class PrefillPeers:
    """Connections from this decode worker's agent to prefill workers, by URL."""

    def __init__(self, agent: KVTransferAgent, timeout_s: float) -> None:
        self.agent = agent
        self.timeout_s = timeout_s
        self._pairs: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def pair(self, session: aiohttp.ClientSession, url: str) -> str:
        """The pair id shared with the prefill worker at `url`, connecting first if
        needed. Raises HandoffError."""
        lock = self._locks.setdefault(url, asyncio.Lock())
        async with lock:
            if url not in self._pairs:
                self._pairs[url] = await self._connect(session, url)
            return self._pairs[url]

    def forget(self, url: str) -> None:
        """Drop a connection (the peer failed); the next hand-off reconnects."""
        self._pairs.pop(url, None)

    async def _connect(self, session: aiohttp.ClientSession, url: str) -> str:
        pair = uuid.uuid4().hex
        # The agent's side of the meeting may block until the peer joins, so it runs
        # beside the request that makes the peer join.
        accepting = asyncio.ensure_future(
            asyncio.to_thread(self.agent.accept, pair, self.timeout_s)
        )
        body = ConnectRequest(peer=pair, metadata=self.agent.metadata()).model_dump()
        try:
            raw = await _post(session, f"{url}/pd/connect", body, self.timeout_s)
            answer = ConnectAnswer.model_validate(raw)
            peer_layout = KVLayout.from_json(answer.metadata["layout"])
            self.agent.layout.check_compatible(
                peer_layout, local="the decode worker", remote="the prefill worker"
            )
            await accepting
        except LayoutMismatchError as error:
            raise HandoffError(str(error), "layout_mismatch") from error
        except (TransferError, ValueError, KeyError) as error:
            raise HandoffError(f"could not connect to {url}: {error}", "connect_failed") from error
        finally:
            if not accepting.done():
                accepting.cancel()
        log.info("connected to prefill worker %s (pair %s)", url, pair)
        return pair


class DecodeHandoff:
    """Runs requests whose prompt a prefill worker computes."""

    def __init__(
        self,
        engine: AsyncEngine,
        agent: KVTransferAgent,
        metrics: HandoffObserver,
        policy: str = "recompute",
        lease_s: float = 30.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown transfer failure policy {policy!r}; known: {POLICIES}")
        self.engine = engine
        self.agent = agent
        self.metrics = metrics
        self.policy = policy
        self.lease_s = lease_s
        self.peers = PrefillPeers(agent, timeout_s=lease_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the HTTP session to prefill workers."""
        if self._session is not None:
            await self._session.close()

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        prefill_url: str,
        on_fallback: Callable[[], None] = lambda: None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, its prompt prefilled by the worker at `prefill_url`.
        Raises HandoffError under the `fail` policy; calls `on_fallback` when the
        prompt is prefilled here instead."""
        started = time.monotonic()
        try:
            adopt = await self._prefill_remotely(request_id, list(prompt), params, prefill_url)
        except HandoffError as error:
            self.metrics.observe_transfer_failure(error.code)
            if self.policy == "fail":
                raise
            log.warning("hand-off of %s failed (%s); prefilling here", request_id, error)
            on_fallback()
            async for output in self.engine.generate(prompt, params, request_id):
                yield output
            return
        self.metrics.observe_kv_wait(time.monotonic() - started)
        async for output in self.engine.stream(request_id, adopt):
            yield output

    async def _prefill_remotely(
        self, request_id: str, prompt: list[int], params: SamplingParams, url: str
    ) -> Admit:
        session = self._http()
        pair = await self.peers.pair(session, url)
        reservation = await self.engine.call(
            lambda engine: engine.reserve(request_id, prompt, params, self.lease_s)
        )
        if reservation is None:
            raise HandoffError("no free KV blocks to reserve for the prompt", "no_blocks")
        pending: PendingReceive | None = None
        try:
            pending = self.agent.expect(pair, reservation.block_ids, request_id)
            answer = await self._ask_prefill(session, url, pair, prompt, params, reservation)
            remaining = max(0.0, reservation.deadline - time.monotonic())
            await asyncio.to_thread(pending.wait, remaining)
        except BaseException as error:
            if pending is not None:
                pending.cancel()
            # A cancelled receive may end the connection (torch drops the pair's
            # group): the next hand-off to this peer connects again.
            self.peers.forget(url)
            self.engine.abort(request_id)  # releases the reservation
            if isinstance(error, TransferError):
                raise HandoffError(f"KV transfer failed: {error}", "transfer_failed") from error
            raise
        self.metrics.observe_transfer(
            TransferStats(answer.bytes, answer.transfer_seconds, answer.descriptors)
        )
        first_token = answer.first_token

        def adopt(engine: LLMEngine) -> list[RequestOutput]:
            return engine.adopt(request_id, Sampled([first_token]))

        return adopt

    async def _ask_prefill(
        self,
        session: aiohttp.ClientSession,
        url: str,
        pair: str,
        prompt: list[int],
        params: SamplingParams,
        reservation: Reservation,
    ) -> PrefillAnswer:
        body = PrefillRequest(
            peer=pair,
            request_id=reservation.request_id,
            prompt_token_ids=prompt,
            sampling=WireSampling.of(params),
            block_ids=reservation.block_ids,
            first_block=reservation.first_block,
            lease_ms=int(self.lease_s * 1000),
        )
        timeout = max(0.0, reservation.deadline - time.monotonic())
        raw = await _post(session, f"{url}/pd/prefill", body.model_dump(), timeout)
        try:
            return PrefillAnswer.model_validate(raw)
        except ValueError as error:
            raise HandoffError(
                f"{url} answered a malformed hand-off: {error}", "bad_handoff"
            ) from error

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float
) -> Any:
    """POST JSON; the answer's JSON, or HandoffError with the peer's reason."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=body, timeout=timeout) as response:
            answer = await response.json(content_type=None)
            if response.status == 200:
                return answer
            error = (answer or {}).get("error", {}) if isinstance(answer, dict) else {}
            message = error.get("message", f"HTTP {response.status}")
            raise HandoffError(f"{url}: {message}", str(error.get("code", "prefill_failed")))
    except TimeoutError as error:
        raise HandoffError(
            f"{url} did not answer within the lease ({timeout_s:.1f}s)", "lease_expired"
        ) from error
    except (aiohttp.ClientError, ValueError) as error:
        raise HandoffError(f"{url} failed: {error}", "prefill_failed") from error
