"""The router's HTTP API: OpenAI-compatible `/v1/completions` and
`/v1/chat/completions` (SSE passed through as it streams), `/tokenize` and
`/detokenize` (answered here, with the model's tokenizer), `/v1/models`, the probes
`/health` and `/ready`, `/workers` (what discovery found, and each worker's state),
`/metrics` and `/openapi.json`, on the router's own HTTP/1.1 server (`network.http1`,
`routes`). Every error is answered in OpenAI's shape.

Each request is validated and tokenized exactly as a worker does it (the chat
template included), so its bucket is the prompt length the worker will see; it then
passes the worker's limits and the router's admission control before it is forwarded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter

from pdserve.protocol.api_errors import APIError, read_body
from pdserve.protocol.headers import REQUEST_ID_HEADER
from pdserve.protocol.limits import Admission, RequestLimits
from pdserve.protocol.models import ServedModel
from pdserve.protocol.prompts import chat_prompt, completion_prompt
from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
from pdserve.protocol.response_models import probe_answer
from pdserve.protocol.routing import (
    KubernetesDiscovery,
    Role,
    RoutingFileError,
    RoutingTable,
    parse_table,
)
from pdserve.protocol.sampling import InvalidRequestError
from pdserve.protocol.tokenization import TokenizationServing
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.network.http1 import Answer, Request
from pdserve.workers.router.auth import ApiKeys
from pdserve.workers.router.discovery import DiscoverySource, StaticSource
from pdserve.workers.router.kv_scoring import KVPrompt
from pdserve.workers.router.kv_subscriber import KVFeeds
from pdserve.workers.router.metrics import RouterMetrics
from pdserve.workers.router.openapi import router_openapi
from pdserve.workers.router.prompt_ids import with_prompt_ids
from pdserve.workers.router.proxy import Forwarder
from pdserve.workers.router.revisions import RevisionSplit
from pdserve.workers.router.routed import Routed
from pdserve.workers.router.routes import Routes
from pdserve.workers.router.workers import WorkersAnswer, WorkerSet, WorkerState

log = logging.getLogger(__name__)

RELOAD_INTERVAL_S = 1.0
_WORKERS_ANSWER = TypeAdapter(WorkersAnswer)


class RouterServer:
    """A pool's front door: the routing table in force, the workers, the forwarder."""

    def __init__(
        self,
        table: RoutingTable,
        table_bytes: bytes,
        tokenizer: Tokenizer,
        forwarder: Forwarder,
        limits: RequestLimits,
        admission: Admission,
        api_keys: ApiKeys,
        kubeconfig: Path | None = None,
        kv_feeds: KVFeeds | None = None,
    ) -> None:
        self.table = table
        self.kv_feeds = kv_feeds
        self._table_bytes = table_bytes
        self.tokenizer = tokenizer
        self.forwarder = forwarder
        self.metrics: RouterMetrics = forwarder.metrics
        self.limits = limits
        self.admission = admission
        self.api_keys = api_keys
        self.kubeconfig = kubeconfig
        self.model = served_model(table)
        self.tokenization = TokenizationServing(tokenizer, self.model)
        self.sets: dict[Role, WorkerSet] = {
            "prefill": forwarder.prefill,
            "decode": forwarder.decode,
        }
        self.ready = False
        self._request_ids = RequestIds()
        self._discovery: tuple[DiscoverySource, asyncio.Task[None]] | None = None

    def routes(self) -> Routes:
        """The router's routes: its server's one handler."""
        routes = Routes(self.api_keys, self.metrics.observe_error)
        routes.post("/v1/completions", self.completions)
        routes.post("/v1/chat/completions", self.chat_completions)
        routes.post("/tokenize", self.tokenization.tokenize)
        routes.post("/detokenize", self.tokenization.detokenize)
        routes.get("/v1/models", self.models)
        routes.get("/health", self.health)
        routes.get("/ready", self.readiness)
        routes.get("/workers", self.workers)
        routes.get("/metrics", self.prometheus)
        routes.get("/openapi.json", self.openapi)
        return routes

    # -- the OpenAI endpoints ---------------------------------------------------------

    async def completions(self, request: Request) -> Answer:
        """POST /v1/completions."""
        parsed = await read_body(request, CompletionRequest)
        self.model.check(parsed.model)
        tokens = await completion_prompt(self.tokenizer, parsed)
        return await self._route(request, parsed, tokens)

    async def chat_completions(self, request: Request) -> Answer:
        """POST /v1/chat/completions."""
        parsed = await read_body(request, ChatCompletionRequest)
        self.model.check(parsed.model)
        tokens = await chat_prompt(self.tokenizer, parsed)
        return await self._route(request, parsed, tokens)

    async def _route(
        self,
        request: Request,
        parsed: CompletionRequest | ChatCompletionRequest,
        tokens: list[int],
    ) -> Answer:
        arrival = time.monotonic()
        prompt_tokens = len(tokens)
        try:
            params = parsed.sampling_params(default_max_tokens=None)
        except InvalidRequestError as error:
            raise APIError(400, str(error)) from error
        self.limits.check(params)
        self.admission.admit()
        table = self.table
        index = table.bucket_of(prompt_tokens)
        request_id = self._request_ids.next()
        client_id = request.headers.get(REQUEST_ID_HEADER)
        if client_id:
            log.debug("request %s is the client's %s", request_id, client_id[:256])
        body = request.body
        # The worker takes the ids only from a caller with the pool's credential.
        with_ids = with_prompt_ids(body, tokens) if self.forwarder.credential else None
        echoes = isinstance(parsed, CompletionRequest) and parsed.echo
        # By position, in the order Routed declares its fields: a class called with
        # names packs them in a dict and unpacks it again, 2.8x the cost.
        routed = Routed(
            request.path,  # path
            body if with_ids is None else with_ids,  # body
            parsed.stream,  # stream
            prompt_tokens,  # prompt_tokens
            table.bucket_label(index),  # bucket
            table.buckets[index].mode,  # mode
            request_id,  # request_id
            client_id or request_id,  # reply_id
            arrival,  # arrival
            table.slo,  # slo
            params.n,  # choices
            prompt_tokens if echoes else 0,  # echo_tokens
            params.max_tokens != 0,  # generates
            KVPrompt.of(tokens, table) if self.kv_feeds is not None else None,  # kv
            RevisionSplit.of(table, tokens, parsed.user),  # split
            None if with_ids is None else self.tokenizer.fingerprint,  # tokenizer
        )
        return await self.forwarder.serve(request, routed)

    async def models(self, _: Request) -> web.Response:
        """GET /v1/models."""
        return web.json_response(self.model.listing())

    async def openapi(self, _: Request) -> web.Response:
        """GET /openapi.json."""
        return web.json_response(router_openapi())

    # -- probes and state -----------------------------------------------------------------

    async def health(self, _: Request) -> web.Response:
        """GET /health: 200 while the process serves."""
        return probe_answer("ok")

    async def readiness(self, _: Request) -> web.Response:
        """GET /ready: 200 once discovery has reported the pool's workers."""
        if not self.ready:
            return probe_answer("not ready", 503)
        return probe_answer("ready", role="router")

    async def workers(self, _: Request) -> web.Response:
        """GET /workers: every known worker, its breaker state and load."""
        body: WorkersAnswer = {
            role: [
                WorkerState(
                    url=worker.url,
                    state=worker.breaker.state,
                    in_flight=worker.in_flight,
                    published=worker.published,
                    kv=None if self.kv_feeds is None else self.kv_feeds.status(role, worker.url),
                    revision=worker.revision,
                )
                for worker in workers
            ]
            for role, workers in self.sets.items()
        }
        return web.json_response(_WORKERS_ANSWER.dump_python(body, mode="json"))

    async def prometheus(self, _: Request) -> web.Response:
        """GET /metrics."""
        for role, workers in self.sets.items():
            available = len(workers.available())
            self.metrics.set_workers(role, available, len(workers) - available)
        if self.kv_feeds is not None:
            self.kv_feeds.report()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- discovery and the routing file ------------------------------------------------

    def start_discovery(self) -> DiscoverySource:
        """Start (or restart) finding workers as the table says."""
        if self._discovery is not None:
            self._discovery[1].cancel()
        source = _source_for(self.table, self.kubeconfig)
        task = asyncio.create_task(source.run(self._discovered), name="discovery")
        task.add_done_callback(_log_end)
        self._discovery = (source, task)
        return source

    def _discovered(self, role: Role, urls: list[str]) -> None:
        self.sets[role].update(urls)
        if self.kv_feeds is not None:
            self.kv_feeds.track(role, urls)

    async def stop_discovery(self) -> None:
        """Stop the discovery task."""
        if self._discovery is not None:
            task = self._discovery[1]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def watch_table(self, path: Path) -> None:
        """Re-read the routing file when it changes (a ConfigMap update replaces it);
        apply a valid one, refuse a malformed one and keep the table in force."""
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_S)
            try:
                data = path.read_bytes()
            except OSError as error:
                log.warning("cannot read %s: %s", path, error)
                continue
            if data != self._table_bytes:
                self._table_bytes = data
                self.reload(data, str(path))

    def reload(self, data: bytes, source: str) -> bool:
        """Apply a routing file's new contents; False (logged, counted) when refused."""
        try:
            table = parse_table(data, source)
            if table.model != self.table.model or table.pool != self.table.pool:
                raise RoutingFileError(
                    f"{source}: the pool and model cannot change while the router runs (restart it)"
                )
        except RoutingFileError as error:
            log.error("routing file refused, the table in force stays: %s", error)
            self.metrics.reloaded(False)
            return False
        discovery_changed = table.discovery != self.table.discovery
        self.table = table
        if discovery_changed:
            self.start_discovery()
        log.info("routing table reloaded from %s", source)
        self.metrics.reloaded(True)
        return True


class RequestIds:
    """The router's request ids: a random prefix per process and a count, unique
    without a system call per request (as uuid4 makes)."""

    def __init__(self) -> None:
        self._prefix = f"rtr-{secrets.token_hex(8)}-"
        self._count = itertools.count(1)

    def next(self) -> str:
        """A new id."""
        return f"{self._prefix}{next(self._count):x}"


def served_model(table: RoutingTable) -> ServedModel:
    """The model as the router names it: the table's, with the checkpoint's context
    length (capped by the table's maxModelLen), as the workers list it."""
    lengths = [n for n in (table.model.max_model_len, _context_length(table.model.path)) if n]
    return ServedModel(
        name=table.model.name,
        role="router",
        max_model_len=min(lengths) if lengths else None,
        path=table.model.path,
    )


def _context_length(model_dir: str) -> int | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _log_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped: %r", task.get_name(), task.exception())


def _source_for(table: RoutingTable, kubeconfig: Path | None) -> DiscoverySource:
    """The discovery source the table names (Kubernetes' client loaded only for it)."""
    config = table.discovery
    if isinstance(config, KubernetesDiscovery):
        from pdserve.workers.router.kubernetes import EndpointSliceSource, load_access

        return EndpointSliceSource(load_access(kubeconfig), config)
    return StaticSource(config)
