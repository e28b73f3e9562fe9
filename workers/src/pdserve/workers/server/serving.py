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

from pdserve.protocol.api_errors import APIError, error_body, read_body
from pdserve.protocol.headers import (
    CACHED_TOKENS_HEADER,
    HANDOFF_HEADER,
    LOCAL_PREFILL_HEADER,
    MODE_HEADER,
    PREFILL_URL_HEADER,
    PROMPT_TOKEN_IDS_FIELD,
    PROMPT_TOKENIZER_HEADER,
    REQUEST_ID_HEADER,
    header_count,
)
from pdserve.protocol.internal import InternalAuth, PrefillAllowList
from pdserve.protocol.limits import Admission, RequestLimits
from pdserve.protocol.models import ServedModel
from pdserve.protocol.prompts import chat_prompt, completion_prompt
from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
from pdserve.protocol.sampling import InvalidRequestError
from pdserve.workers.engine.async_engine import AsyncEngine
from pdserve.workers.engine.isolation import RequestFailedError
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.handoff.decode import DecodeHandoff
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.server.choices import Choice
from pdserve.workers.server.metrics import WorkerMetrics
from pdserve.workers.server.responses import (
    REQUEST_ERRORS,
    ChoiceDelta,
    PreparedRequest,
    RequestTracker,
    api_error,
    chain,
    completion_body,
    first_output,
    send_event,
)

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
        token_ids = self._routed_ids(request, parsed)
        if token_ids is None:
            token_ids = await completion_prompt(self.tokenizer, parsed)
        prepared = self._prepare(parsed, token_ids, chat=False)
        if parsed.echo:
            prompt = parsed.prompt
            prepared.echo_text = (
                prompt if isinstance(prompt, str) else self.tokenizer.decode(token_ids)
            )
        return await self._serve(request, prepared)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        self._check_role()
        parsed = await read_body(request, ChatCompletionRequest)
        self.model.check(parsed.model)
        token_ids = self._routed_ids(request, parsed)
        if token_ids is None:
            token_ids = await chat_prompt(self.tokenizer, parsed)
        prepared = self._prepare(parsed, token_ids, chat=True)
        return await self._serve(request, prepared)

    def _routed_ids(
        self, request: web.Request, parsed: CompletionRequest | ChatCompletionRequest
    ) -> list[int] | None:
        """The prompt's token ids as the router sent them (`router.prompt_ids`), when it
        tokenized with this worker's tokenizer; None: tokenize it here."""
        fingerprint = request.headers.get(PROMPT_TOKENIZER_HEADER)
        extra = parsed.model_extra or {}
        if fingerprint is None or PROMPT_TOKEN_IDS_FIELD not in extra:
            return None
        self.internal.require(request, f"the header {PROMPT_TOKENIZER_HEADER}")
        if fingerprint != self.tokenizer.fingerprint:
            log.debug("the router's tokenizer is not this worker's: the prompt is tokenized here")
            return None
        ids = extra[PROMPT_TOKEN_IDS_FIELD]
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise APIError(400, f"{PROMPT_TOKEN_IDS_FIELD} must be a list of token ids")
        return ids

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
            model=parsed.model or self.model.name,
            prompt_token_ids=token_ids,
            params=params,
            stream=parsed.stream,
            include_usage=bool(options and options.include_usage),
            chat=chat,
            return_token_ids=parsed.return_token_ids,
            logprobs=params.logprobs is not None,
        )

    async def _serve(self, request: web.Request, prepared: PreparedRequest) -> web.StreamResponse:
        prefill_url = await self._prefill_url(request)
        local_tokens = 0 if prefill_url is None else _local_tokens(request)
        self.admission.admit()
        client_id = request.headers.get(REQUEST_ID_HEADER)
        if client_id:
            prepared.label = client_id[:256]
            log.debug("request %s is the client's %s", prepared.request_id, prepared.label)
        arrival = time.monotonic()
        tracker = RequestTracker(prepared, arrival)
        outputs = self._outputs(prefill_url, prepared, tracker, local_tokens)
        answer = Answer(prepared, self.tokenizer, tracker, self.engine)
        headers = {REQUEST_ID_HEADER: client_id or prepared.request_id}
        try:
            # The first output decides between an answer and an error status; only
            # then does a stream start.
            try:
                first = await first_output(outputs)
            except APIError as error:
                if error.status >= 500:
                    tracker.reason = "error"
                raise
            headers[MODE_HEADER] = tracker.mode
            if tracker.handoff is not None:
                headers[HANDOFF_HEADER] = tracker.handoff
            headers[CACHED_TOKENS_HEADER] = str(first.num_cached_tokens)
            chained = chain(first, outputs)
            if prepared.stream:
                return await self._stream(request, prepared, chained, answer, headers)
            return await self._complete(prepared, chained, answer, headers)
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
        self,
        prefill_url: str | None,
        prepared: PreparedRequest,
        tracker: RequestTracker,
        local_tokens: int,
    ) -> AsyncGenerator[RequestOutput, None]:
        if prefill_url is None or self.handoff is None:
            return self.engine.generate(
                prepared.prompt_token_ids, prepared.params, prepared.request_id,
                label=prepared.label,
            )  # fmt: skip
        tracker.mode = "disaggregated"

        def served_here(why: str) -> None:
            tracker.mode, tracker.handoff = "colocated", why

        return self.handoff.generate(
            prepared.request_id, prepared.prompt_token_ids, prepared.params,
            prefill_url, served_here, local_tokens,
        )  # fmt: skip

    async def _complete(
        self,
        prepared: PreparedRequest,
        outputs: AsyncIterator[RequestOutput],
        answer: Answer,
        headers: dict[str, str],
    ) -> web.Response:
        try:
            async for _ in _deltas(prepared, outputs, answer):
                pass
        except REQUEST_ERRORS as error:
            raise api_error(error) from error
        whole = [choice.whole for choice in answer.choices]
        body = completion_body(prepared, whole, final=True, usage=answer.tracker.usage())
        return web.json_response(text=body.model_dump_json(), headers=headers)

    async def _stream(
        self,
        request: web.Request,
        prepared: PreparedRequest,
        outputs: AsyncIterator[RequestOutput],
        answer: Answer,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        try:
            async for delta in _deltas(prepared, outputs, answer):
                if delta is not None:
                    await send_event(response, completion_body(prepared, [delta], final=False))
        except REQUEST_ERRORS as error:
            failure = api_error(error)
            await send_event(response, error_body(str(failure), failure.kind, failure.code))
        if prepared.include_usage:
            usage = answer.tracker.usage()
            await send_event(response, completion_body(prepared, [], final=False, usage=usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _deltas(
    prepared: PreparedRequest, outputs: AsyncIterator[RequestOutput], answer: Answer
) -> AsyncGenerator[ChoiceDelta | None, None]:
    """What to send of each output until every choice ended. Anything that goes wrong
    in building the answer is this request's failure alone (RequestFailedError)."""
    try:
        async for output in outputs:
            yield answer.add(output)
            if answer.ended:
                return
    except REQUEST_ERRORS:
        answer.tracker.reason = "error"
        raise
    except Exception as error:
        answer.tracker.reason = "error"
        failure = RequestFailedError(prepared.request_id, error)
        log.error("%s (client id %s)", failure, prepared.label, exc_info=error)
        raise failure from error


class Answer:
    """The choices of one request as its outputs arrive (interleaved, each with its
    choice's index). A choice that reaches a stop string ends there: with n > 1 the
    engine is told to stop that choice alone; with n = 1 the request ends."""

    def __init__(
        self,
        prepared: PreparedRequest,
        tokenizer: Tokenizer,
        tracker: RequestTracker,
        engine: AsyncEngine,
    ) -> None:
        self.prepared = prepared
        self.tracker = tracker
        self.engine = engine
        self.choices = [Choice(index, prepared, tokenizer) for index in range(prepared.params.n)]

    @property
    def ended(self) -> bool:
        """Whether every choice has ended."""
        return all(choice.ended for choice in self.choices)

    def add(self, output: RequestOutput) -> ChoiceDelta | None:
        """Take an output; what to send of its choice (None: the choice had ended)."""
        choice = self.choices[output.index]
        if choice.ended:  # e.g. the last word of a choice stopped by a stop string
            return None
        delta = choice.add(output)
        self.tracker.record(output, choice.reason)
        if choice.stopped_by_text and output.finish_reason is None and not self.ended:
            self.engine.abort(self.prepared.request_id, choice.index)
        return delta


# Above any prompt a worker takes: a larger count in the header is a peer's error.
_MOST_LOCAL_TOKENS = 1 << 24


def _local_tokens(request: web.Request) -> int:
    """The prompt tokens the router lets this decode worker compute itself instead of
    handing the prompt off (its pool's colocated bound; 0 without the header). Sent
    only with the pool's credential, checked before this is read."""
    value = request.headers.get(LOCAL_PREFILL_HEADER)
    if value is None:
        return 0
    tokens = header_count(value, _MOST_LOCAL_TOKENS)
    if tokens is None:
        raise APIError(
            400, f"the header {LOCAL_PREFILL_HEADER} must be a whole number of tokens "
            f"from 0 to {_MOST_LOCAL_TOKENS}",
        )  # fmt: skip
    return tokens
