"""The OpenAI-compatible completions and chat completions of a worker: parse and
validate once, tokenize, admit, run on the engine (or through a P/D hand-off), and
answer whole or as an SSE stream.

Every request either streams to its end or gets a 4xx/5xx with a reason; a client
that goes away aborts its request (aiohttp cancels the handler), which frees its KV
blocks at once. The engine's request id is the worker's own; a client's
`X-Request-Id` is echoed and logged, never used as a key, so clients that reuse ids
do not collide.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from aiohttp import web

from pdserve.workers.api_errors import APIError, read_body
from pdserve.workers.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.workers.engine.sampling import InvalidRequestError
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.workers.handoff.decode import DecodeHandoff
from pdserve.workers.handoff.protocol import PREFILL_URL_HEADER
from pdserve.workers.headers import MODE_HEADER, REQUEST_ID_HEADER
from pdserve.workers.server.internal import InternalAuth, PrefillAllowList
from pdserve.workers.server.limits import Admission, RequestLimits
from pdserve.workers.server.metrics import WorkerMetrics
from pdserve.workers.server.models import ServedModel
from pdserve.workers.server.prompts import chat_prompt, completion_prompt
from pdserve.workers.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.workers.server.responses import (
    PreparedRequest,
    RequestTracker,
    chain,
    completion_body,
    first_output,
    send_event,
)
from pdserve.workers.server.text_stream import TextStream

log = logging.getLogger(__name__)


class OpenAIServing:
    """Completions and chat completions on one engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        metrics: WorkerMetrics,
        model: ServedModel,
        limits: RequestLimits,
        admission: Admission,
        handoff: DecodeHandoff | None = None,
        internal: InternalAuth | None = None,
        prefill_peers: PrefillAllowList | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model = model
        self.limits = limits
        self.admission = admission
        self.handoff = handoff
        self.internal = internal or InternalAuth(None)
        self.prefill_peers = prefill_peers or PrefillAllowList([])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        self._check_role()
        parsed = await read_body(request, CompletionRequest)
        self.model.check(parsed.model)
        token_ids = await completion_prompt(self.tokenizer, parsed)
        prepared = self._prepare(parsed, token_ids, chat=False)
        return await self._serve(request, prepared)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        self._check_role()
        parsed = await read_body(request, ChatCompletionRequest)
        self.model.check(parsed.model)
        token_ids = await chat_prompt(self.tokenizer, parsed)
        prepared = self._prepare(parsed, token_ids, chat=True)
        return await self._serve(request, prepared)

    def _check_role(self) -> None:
        if self.model.role == "prefill":
            raise APIError(
                400, "this is a prefill worker: send completions to a decode worker, with "
                f"the header {PREFILL_URL_HEADER} naming this worker",
            )  # fmt: skip

    def _prepare(
        self,
        parsed: CompletionRequest | ChatCompletionRequest,
        token_ids: list[int],
        chat: bool,
    ) -> PreparedRequest:
        try:
            params = parsed.sampling_params(default_max_tokens=None)
            self.engine.engine.validate(token_ids, params)
        except InvalidRequestError as error:
            raise APIError(400, str(error)) from error
        self.limits.check(params)
        prefix = "chatcmpl" if chat else "cmpl"
        options = parsed.stream_options
        return PreparedRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            params=params,
            stream=parsed.stream,
            include_usage=bool(options and options.include_usage),
            chat=chat,
            return_token_ids=parsed.return_token_ids,
        )

    async def _serve(self, request: web.Request, prepared: PreparedRequest) -> web.StreamResponse:
        prefill_url = await self._prefill_url(request)
        self.admission.admit()
        client_id = request.headers.get(REQUEST_ID_HEADER)
        if client_id:
            log.debug("request %s is the client's %s", prepared.request_id, client_id[:256])
        arrival = time.monotonic()
        tracker = RequestTracker(prepared, arrival)
        outputs = self._outputs(prefill_url, prepared, tracker)
        text = TextStream(
            IncrementalDetokenizer(self.tokenizer, prepared.prompt_token_ids),
            prepared.params.stop,
            prepared.params.include_stop_str_in_output,
            prepared.params.min_tokens,
        )
        headers = {REQUEST_ID_HEADER: client_id or prepared.request_id}
        try:
            # The first output decides between an answer and an error status; only
            # then does a stream start.
            first = await first_output(outputs)
            headers[MODE_HEADER] = tracker.mode
            chained = chain(first, outputs)
            if prepared.stream:
                return await self._stream(request, prepared, chained, text, tracker, headers)
            return await self._complete(prepared, chained, text, tracker, headers)
        finally:
            await outputs.aclose()  # aborts the request if it had not finished
            self.metrics.observe_request(
                len(prepared.prompt_token_ids),
                tracker.token_times,
                arrival,
                tracker.reason,
                tracker.mode,
            )

    async def _prefill_url(self, request: web.Request) -> str | None:
        """The prefill worker a request names, once the caller is known to be the
        pool's router and the worker one of the pool's; before any connection."""
        prefill_url = request.headers.get(PREFILL_URL_HEADER)
        if prefill_url is None:
            return None
        self.internal.require(request, f"the header {PREFILL_URL_HEADER}")
        if self.handoff is None:
            raise APIError(
                400, f"this worker takes no prefill hand-offs ({PREFILL_URL_HEADER}): "
                "start it with --role decode",
            )  # fmt: skip
        return await self.prefill_peers.admit(prefill_url)

    def _outputs(
        self, prefill_url: str | None, prepared: PreparedRequest, tracker: RequestTracker
    ) -> AsyncGenerator[RequestOutput, None]:
        if prefill_url is None or self.handoff is None:
            return self.engine.generate(
                prepared.prompt_token_ids, prepared.params, prepared.request_id
            )
        tracker.mode = "disaggregated"

        def fell_back() -> None:
            tracker.mode = "colocated"

        return self.handoff.generate(
            prepared.request_id, prepared.prompt_token_ids, prepared.params,
            prefill_url, on_fallback=fell_back,
        )  # fmt: skip

    async def _complete(
        self,
        prepared: PreparedRequest,
        outputs: AsyncIterator[RequestOutput],
        text: TextStream,
        tracker: RequestTracker,
        headers: dict[str, str],
    ) -> web.Response:
        pieces = []
        try:
            async for output in outputs:
                pieces.append(text.add(output.new_token_ids).text)
                tracker.record(output)
                if text.stopped:
                    tracker.reason = "stop"
                    break
        except EngineDeadError as error:
            raise APIError(503, str(error), "server_error") from error
        pieces.append(text.flush())
        body = completion_body(prepared, "".join(pieces), tracker.reason, final=True)
        if prepared.return_token_ids:
            body["choices"][0]["token_ids"] = tracker.token_ids
        body["usage"] = tracker.usage()
        return web.json_response(body, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        prepared: PreparedRequest,
        outputs: AsyncIterator[RequestOutput],
        text: TextStream,
        tracker: RequestTracker,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        try:
            async for output in outputs:
                delta = text.add(output.new_token_ids)
                tracker.record(output)
                if text.stopped:
                    tracker.reason = "stop"
                done = output.finished or text.stopped
                piece = delta.text + (text.flush() if done else "")
                reason = tracker.reason if done else None
                chunk = completion_body(prepared, piece, reason, final=False)
                if prepared.return_token_ids:
                    chunk["choices"][0]["token_ids"] = list(output.new_token_ids)
                await send_event(response, chunk)
                if done:
                    break
        except EngineDeadError as error:
            await send_event(response, {"error": {"message": str(error), "type": "server_error"}})
        if prepared.include_usage:
            usage_chunk = completion_body(prepared, "", None, final=False)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = tracker.usage()
            await send_event(response, usage_chunk)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
