"""A worker's HTTP API: OpenAI-compatible completions and chat completions (with SSE
streaming), `/v1/models`, `/health`, `/ready` and `/metrics`.

Every request either streams to its end or gets a 4xx/5xx with a reason; a client
that goes away aborts its request (aiohttp cancels the handler), which frees its KV
blocks at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.workers.api_errors import APIError, error_middleware, read_body
from pdserve.workers.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.workers.engine.sampling import InvalidRequestError
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.workers.handoff.decode import DecodeHandoff
from pdserve.workers.handoff.prefill import PrefillService
from pdserve.workers.handoff.protocol import PREFILL_URL_HEADER
from pdserve.workers.server.metrics import WorkerMetrics
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


@dataclass(frozen=True)
class WorkerInfo:
    """What the server says about itself."""

    model_name: str
    role: str
    max_model_len: int


class WorkerServer:
    """The HTTP front of one engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        metrics: WorkerMetrics,
        info: WorkerInfo,
        handoff: DecodeHandoff | None = None,
        prefill: PrefillService | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.info = info
        self.handoff = handoff
        self.prefill = prefill
        self.ready = False

    def app(self) -> web.Application:
        """The aiohttp application."""
        middlewares = [error_middleware(self._count_error)]
        app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.readiness)
        app.router.add_get("/metrics", self.prometheus)
        if self.prefill is not None:
            self.prefill.add_routes(app)
        return app

    def _count_error(self, status: int) -> None:
        if 400 <= status < 500:
            self.metrics.observe_rejected()

    # -- OpenAI API ------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        self._check_role()
        parsed = await read_body(request, CompletionRequest)
        self._check_model(parsed.model)
        prompt = parsed.prompt
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = [int(token) for token in prompt]  # type: ignore[arg-type]
        prepared = self._prepare(request, parsed, token_ids, chat=False)
        return await self._serve(request, prepared)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        self._check_role()
        parsed = await read_body(request, ChatCompletionRequest)
        self._check_model(parsed.model)
        messages = [{"role": m.role, "content": m.text()} for m in parsed.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as error:  # a template may raise on unusual conversations
            raise APIError(400, f"messages do not fit the chat template: {error}") from error
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        prepared = self._prepare(request, parsed, token_ids, chat=True)
        return await self._serve(request, prepared)

    async def models(self, _: web.Request) -> web.Response:
        """GET /v1/models."""
        model = {
            "id": self.info.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": self.info.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    # -- probes and metrics ----------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        """GET /health: 200 while the engine loop lives."""
        if not self.engine.healthy:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})

    async def readiness(self, _: web.Request) -> web.Response:
        """GET /ready: 200 once the model is loaded and warmed up."""
        if not (self.ready and self.engine.healthy):
            return web.json_response({"status": "not ready"}, status=503)
        return web.json_response({"status": "ready", "role": self.info.role})

    async def prometheus(self, _: web.Request) -> web.Response:
        """GET /metrics."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- serving ---------------------------------------------------------------

    def _check_role(self) -> None:
        if self.info.role == "prefill":
            raise APIError(
                400, "this is a prefill worker: send completions to a decode worker, with "
                f"the header {PREFILL_URL_HEADER} naming this worker",
            )  # fmt: skip

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.info.model_name:
            raise APIError(
                404, f"model {model!r} is not served here; this worker serves "
                f"{self.info.model_name!r}", "invalid_request_error", "model_not_found",
            )  # fmt: skip

    def _prepare(
        self,
        request: web.Request,
        parsed: CompletionRequest | ChatCompletionRequest,
        token_ids: list[int],
        chat: bool,
    ) -> PreparedRequest:
        try:
            params = parsed.sampling_params(default_max_tokens=None)
            self.engine.engine.validate(token_ids, params)
        except InvalidRequestError as error:
            raise APIError(400, str(error)) from error
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"
        options = parsed.stream_options
        return PreparedRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            stream=parsed.stream,
            include_usage=bool(options and options.include_usage),
            chat=chat,
            return_token_ids=parsed.return_token_ids,
        )

    async def _serve(self, request: web.Request, prepared: PreparedRequest) -> web.StreamResponse:
        arrival = time.monotonic()
        tracker = RequestTracker(prepared, arrival)
        outputs = self._outputs(request, prepared, tracker)
        text = TextStream(
            IncrementalDetokenizer(self.tokenizer, prepared.prompt_token_ids),
            prepared.params.stop,
            prepared.params.include_stop_str_in_output,
        )
        try:
            # The first output decides between an answer and an error status; only
            # then does a stream start.
            first = await first_output(outputs)
            chained = chain(first, outputs)
            if prepared.stream:
                return await self._stream(request, prepared, chained, text, tracker)
            return await self._complete(prepared, chained, text, tracker)
        finally:
            await outputs.aclose()  # aborts the request if it had not finished
            self.metrics.observe_request(
                len(prepared.prompt_token_ids),
                tracker.token_times,
                arrival,
                tracker.reason,
                tracker.mode,
            )

    def _outputs(
        self, request: web.Request, prepared: PreparedRequest, tracker: RequestTracker
    ) -> AsyncGenerator[RequestOutput, None]:
        prefill_url = request.headers.get(PREFILL_URL_HEADER)
        if prefill_url is None:
            return self.engine.generate(
                prepared.prompt_token_ids, prepared.params, prepared.request_id
            )
        if self.handoff is None:
            raise APIError(
                400, f"this worker takes no prefill hand-offs ({PREFILL_URL_HEADER}): "
                "start it with --role decode",
            )  # fmt: skip
        tracker.mode = "disaggregated"

        def fell_back() -> None:
            tracker.mode = "colocated"

        return self.handoff.generate(
            prepared.request_id, prepared.prompt_token_ids, prepared.params,
            prefill_url.rstrip("/"), on_fallback=fell_back,
        )  # fmt: skip

    async def _complete(
        self,
        prepared: PreparedRequest,
        outputs: AsyncIterator[RequestOutput],
        text: TextStream,
        tracker: RequestTracker,
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
        return web.json_response(body)

    async def _stream(
        self,
        request: web.Request,
        prepared: PreparedRequest,
        outputs: AsyncIterator[RequestOutput],
        text: TextStream,
        tracker: RequestTracker,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
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
