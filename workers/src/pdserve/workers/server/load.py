"""What a worker publishes about its load at GET /load, for the router's choice of
worker: requests in flight, running and queued, KV cache usage, and the prompt tokens
still to be prefilled. The engine's part is taken after each step, on the engine
thread (where its queues may be read); the server's part is counted per request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import chain

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.workers.engine.engine import LLMEngine, StepResult

# Requests on these paths count as in flight.
_SERVED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/pd/prefill")


@dataclass(frozen=True)
class WorkerLoad:
    """The body of GET /load."""

    role: str
    in_flight: int  # requests the server is answering
    running: int  # requests in the engine's running batch
    waiting: int  # requests waiting for their first engine step
    kv_cache_usage: float  # fraction of KV blocks in use
    prefill_tokens: int  # prompt tokens admitted and not yet computed
    revision: str = ""  # its --revision: the router splits a rollout's traffic by it


class LoadTracker:
    """Keeps a worker's load; an engine observer and a server middleware."""

    def __init__(self, engine: LLMEngine, role: str, revision: str = "") -> None:
        self._engine = engine
        self._role = role
        self._revision = revision
        self._in_flight = 0
        self._running = 0
        self._kv_usage = 0.0
        self._prefill_tokens = 0

    def on_step(self, result: StepResult) -> None:
        """After each step (engine thread): the batch, the cache and the prefill backlog."""
        scheduler = self._engine.scheduler
        self._running = result.stats.num_running
        self._kv_usage = result.stats.kv_cache_usage
        self._prefill_tokens = sum(
            max(0, request.num_prompt_tokens - request.num_computed_tokens)
            for request in chain(scheduler.waiting, scheduler.running)
        )

    def snapshot(self, waiting: int) -> WorkerLoad:
        """The load now; `waiting` is the engine's admission queue."""
        idle = self._in_flight == 0
        return WorkerLoad(
            role=self._role,
            in_flight=self._in_flight,
            running=0 if idle else self._running,
            waiting=waiting,
            kv_cache_usage=self._kv_usage,
            prefill_tokens=0 if idle else self._prefill_tokens,
            revision=self._revision,
        )

    def request_started(self) -> None:
        """A served request came in (the middleware's count, or the planner's)."""
        self._in_flight += 1

    def request_ended(self) -> None:
        """A served request was answered or failed."""
        self._in_flight -= 1

    def middleware(self) -> Middleware:
        """Counts the requests in flight."""

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not request.path.startswith(_SERVED_PREFIXES):
                return await handler(request)
            self.request_started()
            try:
                return await handler(request)
            finally:
                self.request_ended()

        return count

    def answer(self, waiting: int) -> web.Response:
        """GET /load."""
        return web.json_response(asdict(self.snapshot(waiting)))
