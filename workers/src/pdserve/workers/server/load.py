"""What a worker publishes about its load at GET /load, for the router's choice of
worker: requests in flight, running and queued, KV cache usage, the prompt tokens
still to be prefilled, and what its steps cost (its engine's step-cost model, learned
from its own steps: the KV-aware router predicts a request's time to first token on
it from them). So that the prediction includes waiting for a seat in the running
batch or for KV blocks, it also publishes the batch's seats (`max_num_seqs`), its
blocks (`num_kv_blocks`, `kv_blocks_free`: free or only cached, so reusable now) and,
for each running request, the steps it has left at most and the blocks it holds
(`finishing`, soonest first): what a seat or blocks wait for. The engine's part is
taken after each step, on the engine thread (where its queues may be read); the
server's part is counted per request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.step_cost import StepFeatures

# Requests on these paths count as in flight.
_SERVED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/pd/prefill")


@dataclass(frozen=True)
class StepCosts:
    """What the worker's steps cost, in seconds, as its engine's step-cost model has
    learned them (published once it has learned from `steps` steps, the model's
    warm-up)."""

    base_s: float  # a step's fixed cost
    prefill_token_s: float  # per prompt token computed
    prefill_key_s: float  # per cached token a prompt token's attention reads
    decode_token_s: float  # per request decoding in a step
    decode_s: float  # the decodes of its last step, keys included
    decodes: int  # requests decoding in its last step
    step_tokens: int  # the tokens its last step was allowed (its token budget)
    steps: int  # steps the model has learned from
    # Prompt tokens it learned its prefill costs from, recent ones counting more (as
    # in the fit): the router weighs its prefill costs against its peers' by them.
    prefill_tokens: int


@dataclass(frozen=True)
class WorkerLoad:
    """The body of GET /load."""

    role: str
    in_flight: int  # requests the server is answering
    running: int  # requests in the engine's running batch
    waiting: int  # requests waiting for their first engine step
    kv_cache_usage: float  # fraction of KV blocks in use
    prefill_tokens: int  # prompt tokens admitted and not yet computed (cached ones not counted)
    revision: str = ""  # its --revision: the router splits a rollout's traffic by it
    step_costs: StepCosts | None = None  # None until its cost model has warmed up
    max_num_seqs: int = 0  # seats of the running batch
    num_kv_blocks: int = 0  # blocks of its KV cache
    kv_blocks_free: int = 0  # blocks no request holds (free, or cached and unused)
    # Each running request's [steps left at most, blocks held], soonest first: its
    # prompt still to compute in full steps, then the tokens max_tokens still allows.
    finishing: list[tuple[int, int]] = field(default_factory=list)
    # The order its prompts take a step's budget (`--prefill-order`): the router
    # predicts a new prompt's wait from the prompts this order serves before it.
    prefill_order: str = "arrival"


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
        self._step_costs: StepCosts | None = None
        self._kv_blocks_free = engine.kv_cache.pool.num_blocks
        self._finishing: list[tuple[int, int]] = []

    def on_step(self, result: StepResult) -> None:
        """After each step (engine thread): the batch, the cache and the prefill backlog."""
        scheduler = self._engine.scheduler
        self._running = result.stats.num_running
        self._kv_usage = result.stats.kv_cache_usage
        # A waiting prompt's cached prefix is not work left: counted, it would look to
        # the router like prompts it never sent (its own count is of uncached tokens).
        self._prefill_tokens = scheduler.prompt_tokens_left()
        if result.chunks:
            self._step_costs = self._costs(result)
        self._kv_blocks_free = self._engine.kv_cache.pool.num_free
        self._finishing = self._running_requests(result.stats.token_budget)

    def _running_requests(self, step_tokens: int) -> list[tuple[int, int]]:
        """[steps left at most, blocks held] of each running request, soonest first."""
        kv_cache = self._engine.kv_cache
        found = []
        for request in self._engine.scheduler.running:
            prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
            outputs_left = max(0, (request.params.max_tokens or 0) - len(request.output_token_ids))
            steps = -(-prompt_left // max(1, step_tokens)) + outputs_left
            found.append((steps, len(kv_cache.block_table(request.request_id))))
        return sorted(found)

    def _costs(self, result: StepResult) -> StepCosts | None:
        """The cost model's estimate and the decodes of the step just run (None while
        the model warms up)."""
        model = self._engine.step_cost
        if model.num_steps < model.warmup_steps:
            return None
        estimate = model.estimate()
        features = StepFeatures.of(result.chunks)
        decodes = StepFeatures(
            decode_tokens=features.decode_tokens, decode_keys=features.decode_keys
        )
        return StepCosts(
            base_s=estimate.base_s,
            prefill_token_s=estimate.per_prefill_token_s,
            prefill_key_s=estimate.per_prefill_key_s,
            decode_token_s=estimate.per_decode_token_s,
            decode_s=max(0.0, model.predict(decodes) - estimate.base_s),
            decodes=features.decode_tokens,
            step_tokens=result.stats.token_budget,
            steps=estimate.num_steps,
            prefill_tokens=round(estimate.prefill_tokens),
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
            step_costs=self._step_costs,
            max_num_seqs=self._engine.scheduler.config.max_num_seqs,
            num_kv_blocks=self._engine.kv_cache.pool.num_blocks,
            kv_blocks_free=self._kv_blocks_free,
            finishing=[] if idle else self._finishing,
            prefill_order=self._engine.scheduler.config.prefill_order,
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
