"""Forwarding one request to the pool and relaying the answer.

The routing table chose the request's path; this module picks the workers for it
(by load, among those whose circuit breaker allows), sends the client's body to a
decode worker with the pool's credential (and, for a disaggregated request, the
prefill worker in `X-Pdserve-Prefill-Url`), and relays the answer: whole, or as an
SSE stream passed through as it arrives.

Until the first byte of an answer reaches the client, a failed attempt is retried:
on another decode worker when the decode worker failed, with another prefill worker
(or colocated, counted as a fallback) when the hand-off failed. Once streaming, a
worker that fails ends the stream with an SSE error event. Each attempt carries a
request id of its own; a client that goes away cancels the handler, which closes the
connection to the worker, which aborts the request. Every request is counted under one
outcome however it ends (see `outcome`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

from aiohttp import web

from pdserve.protocol import codec
from pdserve.protocol.api_errors import REQUEST_FAILED, APIError, log_client_gone
from pdserve.protocol.headers import (
    BUCKET_HEADER,
    CACHED_TOKENS_HEADER,
    HANDOFF_HEADER,
    LOCAL_PREFILL_HEADER,
    MODE_HEADER,
    PREFILL_URL_HEADER,
    PROMPT_TOKENIZER_HEADER,
    REQUEST_ID_HEADER,
)
from pdserve.protocol.internal import bearer
from pdserve.protocol.routing import Mode
from pdserve.workers.network.bodies import BUSY_CODES
from pdserve.workers.network.http1 import Answer, Request, StreamedAnswer
from pdserve.workers.router.kv_scoring import KVScorer
from pdserve.workers.router.metrics import RouterMetrics
from pdserve.workers.router.outcome import RequestOutcome, counted
from pdserve.workers.router.revisions import revision_of
from pdserve.workers.router.routed import Routed
from pdserve.workers.router.sse import error_event
from pdserve.workers.router.upstream import UpstreamError, UpstreamResponse, Upstreams
from pdserve.workers.router.workers import Worker, WorkerSet

log = logging.getLogger(__name__)

Blame = Literal["decode", "prefill", "none"]

# Only connecting is bounded: a stream lasts as long as its generation.
CONNECT_TIMEOUT_S = 3.0
# Once a stream's `[DONE]` is relayed, the worker's connection is kept for another
# request if the rest of its answer (nothing but its end) comes within this time.
END_WAIT_S = 10.0
# The worker's headers read for every request, by the lower-case names its answer's
# headers are kept by (no lower() per lookup).
_CACHED_TOKENS = CACHED_TOKENS_HEADER.lower()
_MODE = MODE_HEADER.lower()


class _Retry(Exception):
    """An attempt failed before anything reached the client."""

    def __init__(
        self,
        reason: str,
        message: str,
        blame: Blame,
        answer: web.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.blame = blame
        self.answer = answer  # the worker's own answer, given to the client if all fail


@dataclass(slots=True)
class _Plan:
    """What the attempts so far have ruled out."""

    mode: Mode
    # Replaced, not added to, when an attempt fails (none does, as a rule: no set is
    # made per request).
    tried_decode: frozenset[str] = frozenset()
    tried_prefill: frozenset[str] = frozenset()
    last: _Retry | None = None
    fallback: str = "no_prefill"
    decided: bool = False  # the mode was decided on the decode worker's uncached tokens
    # Prompt tokens the chosen decode and prefill workers hold, by the KV index.
    predicted: tuple[int, int] = (0, 0)


class Outstanding:
    """An attempt counted in the workers' loads and the router's admission queue until
    the decode worker answers (its first token is ready then) or it ends. (A class, not
    a generator's context manager: it wraps every attempt.)"""

    __slots__ = ("_decode", "_forwarder", "_keys", "_prefills", "_tokens", "_waiting")

    def __init__(
        self,
        forwarder: Forwarder,
        routed: Routed,
        decode: Worker,
        prefill: Worker | None,
        predicted: tuple[int, int],
    ) -> None:
        decode.breaker.dispatched()
        decode.in_flight += 1
        # Whoever prefills the prompt has what it lacks of it waiting until the first
        # token (the tokens its prefix cache holds are no work).
        prefills = decode if prefill is None else prefill
        tokens = routed.prompt_tokens - (predicted[0] if prefill is None else predicted[1])
        keys = () if routed.kv is None else routed.kv.keys
        prefills.prefill_sent(tokens, keys)
        if prefill is not None:
            prefill.breaker.dispatched()
        forwarder.awaiting_first_token += 1
        self._forwarder = forwarder
        self._decode = decode
        self._prefills = prefills
        self._tokens = tokens
        self._keys = keys
        self._waiting = True

    def answered(self) -> None:
        """The decode worker answered: its first token is ready."""
        if self._waiting:
            self._waiting = False
            self._forwarder.awaiting_first_token -= 1
            self._prefills.prefill_done(self._tokens, self._keys)

    def ended(self) -> None:
        """The attempt ended, however (call once)."""
        self.answered()
        self._decode.in_flight -= 1


class Forwarder:
    """Sends requests to the workers of a pool."""

    def __init__(
        self,
        upstreams: Upstreams,
        prefill: WorkerSet,
        decode: WorkerSet,
        credential: str | None,
        metrics: RouterMetrics,
        max_attempts: int = 3,
        kv: KVScorer | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.prefill = prefill
        self.decode = decode
        self.credential = credential
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.kv = kv
        self.awaiting_first_token = 0  # the router's admission queue

    async def serve(self, request: Request, routed: Routed) -> Answer:
        """Answer `request` from the pool; APIError when no worker could."""
        with counted(self.metrics, routed) as outcome:
            return outcome.answered(await self._serve(request, routed, outcome))

    async def _serve(self, request: Request, routed: Routed, outcome: RequestOutcome) -> Answer:
        plan = _Plan(routed.mode)
        for attempt in range(1, self.max_attempts + 1):
            decode, prefill = self._choose(routed, plan)
            outcome.mode = plan.mode
            if decode is None:
                break
            try:
                return await self._attempt(
                    request, routed, (decode, prefill), attempt, outcome, plan.predicted
                )
            except _Retry as retry:
                self._note_failure(routed, plan, retry, decode, prefill)
        if plan.last is not None and plan.last.answer is not None:
            return plan.last.answer
        # The client learns that the pool failed, not where: the worker's address and
        # its words go to the log (and were logged with each failed attempt).
        why = f"{plan.last.reason}: {plan.last}" if plan.last is not None else "no worker known"
        log.warning("request %s: no worker could serve it (%s)", routed.request_id, why)
        raise APIError(
            503, "no worker could serve the request", "server_error",
            "no_worker_available", headers={"Retry-After": "1"},
        )  # fmt: skip

    def _choose(self, routed: Routed, plan: _Plan) -> tuple[Worker | None, Worker | None]:
        decode = self._pick(self.decode, routed, plan.tried_decode)
        if self.kv is not None and routed.kv is not None and decode and not plan.decided:
            plan.decided = True  # once: a retry keeps the mode (or falls back)
            plan.mode = self.kv.mode(routed.kv, plan.mode, decode[1])
        prefill = None
        if plan.mode == "disaggregated":
            prefill = self._pick(self.prefill, routed, plan.tried_prefill)
            if prefill is None:
                plan.mode = "colocated"
                self.metrics.fell_back(routed.bucket, plan.fallback)
        plan.predicted = (0 if decode is None else decode[1], 0 if prefill is None else prefill[1])
        return (
            None if decode is None else decode[0],
            None if prefill is None else prefill[0],
        )

    def _pick(
        self, workers: WorkerSet, routed: Routed, tried: frozenset[str]
    ) -> tuple[Worker, int] | None:
        """A worker of `workers` not tried yet, and the prompt tokens it holds cached
        (KV-aware, when the table says so; else by load, holding none known), within
        the request's revision when a rollout splits the traffic."""
        exclude = tried if routed.split is None else tried | routed.split.outside(workers, tried)
        if self.kv is None or routed.kv is None:
            worker = workers.choose(exclude=exclude)
            return None if worker is None else (worker, 0)
        choice = self.kv.choose(workers, routed.kv, exclude=exclude)
        return None if choice is None else (choice.worker, choice.cached_tokens)

    def _note_failure(
        self,
        routed: Routed,
        plan: _Plan,
        retry: _Retry,
        decode: Worker,
        prefill: Worker | None,
    ) -> None:
        log.warning(
            "request %s: attempt on %s failed (%s): %s", routed.request_id, decode.url,
            retry.reason, retry,
        )  # fmt: skip
        self.metrics.retried(retry.reason)
        plan.last = retry
        if retry.blame == "prefill" and prefill is not None:
            prefill.breaker.failed()
            plan.tried_prefill |= {prefill.url}
            plan.fallback = "handoff_failed"
            return
        plan.tried_decode |= {decode.url}
        if retry.blame == "decode":
            decode.breaker.failed()

    async def _attempt(
        self,
        request: Request,
        routed: Routed,
        workers: tuple[Worker, Worker | None],
        attempt: int,
        outcome: RequestOutcome,
        predicted: tuple[int, int],
    ) -> Answer:
        decode, prefill = workers
        headers = {
            REQUEST_ID_HEADER: f"{routed.request_id}-{attempt}",
            **(bearer(self.credential) if self.credential else {}),
        }
        if prefill is not None:
            headers[PREFILL_URL_HEADER] = prefill.url
            if routed.kv is not None:  # the decode worker's exact count decides last
                headers[LOCAL_PREFILL_HEADER] = str(routed.kv.table.colocated_up_to())
        if routed.tokenizer is not None:
            headers[PROMPT_TOKENIZER_HEADER] = routed.tokenizer
        outcome.revisions = (revision_of(prefill), revision_of(decode))
        load = Outstanding(self, routed, decode, prefill, predicted)
        try:
            upstream = await self.upstreams.post(decode.url, routed.path, routed.body, headers)
            try:  # what `async with upstream` does, without its two coroutines
                load.answered()
                if upstream.status != 200:
                    return await self._refusal(routed, upstream, prefill is not None)
                decode.breaker.succeeded()
                if self.kv is not None and routed.kv is not None:
                    found = upstream.headers.get(_CACHED_TOKENS)
                    self.kv.observed(routed.request_id, routed.kv, predicted[0], found)
                if prefill is not None:
                    self._settle_prefill(routed, upstream, prefill)
                outcome.mode = upstream.headers.get(_MODE) or routed.mode
                if routed.stream:
                    return await self._relay_stream(request, routed, upstream, outcome)
                return await self._relay_whole(routed, upstream, outcome)
            finally:
                upstream.close()
        except UpstreamError as error:
            raise _Retry("worker_unreachable", f"{decode.url}: {error}", "decode") from error
        finally:
            load.ended()

    async def _refusal(
        self, routed: Routed, upstream: UpstreamResponse, disaggregated: bool
    ) -> web.Response:
        """A worker's error answer: raise _Retry when another worker (or path) may do
        better, else pass it on (a 4xx, or a 500 for a request that failed alone: the
        request's own fault, which another worker would share)."""
        data = await upstream.read()
        headers = {REQUEST_ID_HEADER: routed.reply_id}
        for name in ("Content-Type", "Retry-After"):
            value = upstream.header(name)
            if value is not None:
                headers[name] = value
        answer = web.Response(body=data, status=upstream.status, headers=headers)
        status, code = upstream.status, _error_code(data)
        message = f"HTTP {status} ({code})"
        if status == 429 or code in BUSY_CODES:  # busy, not failing: no breaker failure
            raise _Retry("worker_busy", message, "none", answer)
        if disaggregated and (status in (401, 403) or (status == 502 and code != "no_blocks")):
            # The pool's own failure, whose words may name its workers: never the
            # client's answer.
            raise _Retry("handoff_failed", message, "prefill")
        if status >= 500 and code != REQUEST_FAILED:
            raise _Retry("worker_failed", message, "decode", answer)
        return answer

    def _settle_prefill(self, routed: Routed, upstream: UpstreamResponse, prefill: Worker) -> None:
        """A hand-off the decode worker fell back from (it prefilled the prompt itself)
        is a fallback and a failure of the prefill worker; one that worked, a success;
        one it did not make, its cache holding the prompt but a few tokens, neither."""
        if upstream.header(MODE_HEADER) == "colocated":
            if upstream.header(HANDOFF_HEADER) == "cached":
                self.metrics.handoff_skipped(routed.bucket)
                return
            prefill.breaker.failed()
            self.metrics.fell_back(routed.bucket, "handoff_failed")
        else:
            prefill.breaker.succeeded()

    def _headers(self, routed: Routed, upstream: UpstreamResponse) -> dict[str, str]:
        return {
            "Content-Type": upstream.headers.get("content-type") or "application/json",
            REQUEST_ID_HEADER: routed.reply_id,
            MODE_HEADER: upstream.headers.get(_MODE) or routed.mode,
            BUCKET_HEADER: routed.bucket,
        }

    async def _relay_whole(
        self, routed: Routed, upstream: UpstreamResponse, outcome: RequestOutcome
    ) -> web.Response:
        try:
            data = await upstream.read()
        except UpstreamError as error:
            raise _Retry("worker_failed", f"the answer broke off: {error}", "decode") from error
        outcome.output_tokens = _tokens_per_choice(data, routed.choices)
        outcome.ended("ok")
        return web.Response(body=data, headers=self._headers(routed, upstream))

    async def _relay_stream(
        self,
        request: Request,
        routed: Routed,
        upstream: UpstreamResponse,
        outcome: RequestOutcome,
    ) -> StreamedAnswer:
        headers = self._headers(routed, upstream)
        headers["Cache-Control"] = "no-cache"
        response: StreamedAnswer | None = None
        tokens = routed.token_stream()
        broken: str | None = None
        try:
            while True:
                try:
                    data = await upstream.next_piece()
                except UpstreamError as error:
                    broken = f"the worker serving this stream failed: {error}"
                    break
                if data is None:
                    break
                now = time.monotonic()
                if response is None:  # its head goes out with its first event
                    response = request.stream(headers)
                    outcome.stream = tokens
                tokens.feed(data, now)
                if tokens.done:  # the last event: it goes with the answer's end, in one write
                    await response.write_eof(data)
                    upstream.end_later(END_WAIT_S)  # the handler is done: the next request
                    break
                await response.write(data)
            if response is None:
                raise _Retry("worker_failed", broken or "the worker sent nothing", "decode")
            if broken is None and not tokens.done:
                broken = "the worker serving this stream ended it early"
            if broken is not None:
                log.warning("request %s: %s", routed.request_id, broken)
                await response.write(error_event(broken, "worker_failed"))
            await response.write_eof()
            outcome.ended("ok" if broken is None and tokens.error is None else "error")
            return response
        except ConnectionResetError:  # the client went away: the worker's stream closes
            assert response is not None
            log_client_gone(request)
            outcome.cancelled()
            return response


def _error_code(data: bytes) -> str:
    try:
        body = codec.loads(data)
    except ValueError:
        return "unknown"
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("code")) if isinstance(error, dict) else "unknown"


def _tokens_per_choice(data: bytes, choices: int) -> int | None:
    """The tokens of each choice of an answer sent whole: its usage's completion
    tokens (of all choices) shared out (the choices decode side by side)."""
    try:
        usage = codec.loads(data).get("usage") or {}
    except (ValueError, AttributeError):
        return None
    tokens = usage.get("completion_tokens")
    return math.ceil(tokens / choices) if isinstance(tokens, int) else None
