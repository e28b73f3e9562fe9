"""A worker's HTTP API: the OpenAI-compatible endpoints (see `serving`), `/tokenize`
and `/detokenize` (see `tokenization`), the P/D hand-off endpoints of a prefill worker
(for holders of the pool's credential only), `/v1/models`, `/openapi.json`, the probes
`/health` and `/ready`, `/load` (for the router) and `/metrics`. Every error, from any
of them, is answered in OpenAI's shape by one middleware
(`pdserve.protocol.api_errors`)."""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.protocol.api_errors import error_middleware
from pdserve.protocol.openapi import (
    OPENAI_ENDPOINTS,
    OPENAI_ERRORS,
    Endpoint,
    openapi_spec,
    probes,
)
from pdserve.protocol.response_models import ProbeAnswer, probe_answer
from pdserve.protocol.tokenization import TokenizationServing
from pdserve.workers.handoff.prefill import PrefillService
from pdserve.workers.network.bodies import guard_middleware
from pdserve.workers.network.guard import NetworkGuard
from pdserve.workers.server.drain import Drain
from pdserve.workers.server.kv_feed import FEED_ENDPOINTS, KVFeed
from pdserve.workers.server.load import LoadTracker, WorkerLoad
from pdserve.workers.server.serving import OpenAIServing

ENDPOINTS = (
    *OPENAI_ENDPOINTS,
    *probes("the engine runs"),
    Endpoint("get", "/load", "Requests in flight, running and queued, KV cache usage, prefill "
             "backlog (for the router)", WorkerLoad, unavailable=ProbeAnswer),
    *FEED_ENDPOINTS,
)  # fmt: skip
ERRORS = {
    **OPENAI_ERRORS,
    401: "a hand-off asked for without the pool's credential",
    403: "a hand-off to a worker that is not one of the pool's",
    429: "too many requests queued (see Retry-After)",
    503: "the request waited too long in the queue, the worker is stopping, or the engine stopped",
}


@functools.cache
def worker_openapi() -> dict[str, Any]:
    """The worker's OpenAPI document (made once)."""
    return openapi_spec("pdserve worker", ENDPOINTS, ERRORS)


class WorkerServer:
    """The HTTP front of one engine."""

    def __init__(
        self,
        serving: OpenAIServing,
        max_body_size: int,
        load: LoadTracker,
        prefill: PrefillService | None = None,
        kv_feed: KVFeed | None = None,
    ) -> None:
        self.serving = serving
        self.engine = serving.engine
        self.metrics = serving.metrics
        self.model = serving.model
        self.handoff = serving.handoff
        self.prefill = prefill
        self.kv_feed = kv_feed
        self.load = load
        self.max_body_size = max_body_size
        self.ready = False
        self.drain = Drain()
        self.tokenization = TokenizationServing(serving.tokenizer, self.model)

    def app(self, guard: NetworkGuard | None = None) -> web.Application:
        """The aiohttp application (under `guard`'s network limits, when given)."""
        middlewares = [
            error_middleware(self.metrics.observe_error),
            self.drain.middleware(),
            self.serving.internal.middleware(),
            self.load.middleware(),
        ]
        if guard is not None:
            middlewares.append(guard_middleware(guard))
        app = web.Application(middlewares=middlewares, client_max_size=self.max_body_size)
        app.router.add_post("/v1/completions", self.serving.completions)
        app.router.add_post("/v1/chat/completions", self.serving.chat_completions)
        app.router.add_post("/tokenize", self.tokenization.tokenize)
        app.router.add_post("/detokenize", self.tokenization.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.readiness)
        app.router.add_get("/load", self.load_report)
        app.router.add_get("/metrics", self.prometheus)
        if self.prefill is not None:
            self.prefill.add_routes(app)
        if self.kv_feed is not None:
            self.kv_feed.add_routes(app)
        return app

    async def models(self, _: web.Request) -> web.Response:
        """GET /v1/models."""
        return web.json_response(self.model.listing())

    async def openapi(self, _: web.Request) -> web.Response:
        """GET /openapi.json."""
        return web.json_response(worker_openapi())

    async def health(self, _: web.Request) -> web.Response:
        """GET /health: 200 while the engine loop lives."""
        if not self.engine.healthy:
            return probe_answer("engine stopped", 503)
        return probe_answer("ok")

    async def readiness(self, _: web.Request) -> web.Response:
        """GET /ready: 200 once the model is loaded and warmed up, while the engine runs
        and the worker is not stopping."""
        if self.drain.draining:
            return probe_answer("draining", 503)
        if not (self.ready and self.engine.healthy):
            return probe_answer("not ready", 503)
        return probe_answer("ready", role=self.model.role)

    async def load_report(self, _: web.Request) -> web.Response:
        """GET /load: what the router weighs when it picks a worker (503 while not
        ready or draining, as /ready, so the router's probe keeps traffic off it)."""
        if self.drain.draining:
            return probe_answer("draining", 503)
        if not (self.ready and self.engine.healthy):
            return probe_answer("not ready", 503)
        return self.load.answer(self.engine.num_queued)

    async def prometheus(self, _: web.Request) -> web.Response:
        """GET /metrics."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
