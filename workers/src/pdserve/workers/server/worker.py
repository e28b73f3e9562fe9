"""Assembling and running a worker: engine, tokenizer, metrics and HTTP server."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import uuid

from aiohttp import web

from pdserve.base.ports import PortInUseError, announce_port, binding, check_port_free
from pdserve.base.version import installed_parts
from pdserve.protocol.internal import (
    CredentialError,
    InternalAuth,
    PrefillAllowList,
    bearer,
    read_credential,
)
from pdserve.protocol.limits import Admission, RequestLimits
from pdserve.protocol.models import ServedModel
from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.async_engine import AsyncEngine
from pdserve.workers.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    TokenBudgetConfig,
)
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.kv_events import KVEventLog
from pdserve.workers.handoff.decode import DecodeHandoff
from pdserve.workers.handoff.prefill import PrefillService
from pdserve.workers.kv_transfer.layout import KVLayout
from pdserve.workers.model.identity import weights_digest
from pdserve.workers.model.tokenizer import Tokenizer
from pdserve.workers.network.guard import NetworkGuard
from pdserve.workers.network.limits import NetworkLimits
from pdserve.workers.network.metrics import NetworkMetrics
from pdserve.workers.network.site import listen
from pdserve.workers.server.app import WorkerServer
from pdserve.workers.server.kv_feed import KVFeed, kv_identity
from pdserve.workers.server.load import LoadTracker
from pdserve.workers.server.metrics import WorkerMetrics
from pdserve.workers.server.options import WorkerOptions
from pdserve.workers.server.serving import OpenAIServing

log = logging.getLogger("pdserve.worker")


def engine_config(options: WorkerOptions) -> EngineConfig:
    """The engine's configuration from the worker's options."""
    return EngineConfig(
        model_dir=options.model,
        device=options.device,
        dtype=options.dtype,
        kv_cache_dtype=None if options.kv_cache_dtype == "auto" else options.kv_cache_dtype,
        max_model_len=options.max_model_len,
        handoff_lease_s=options.handoff_timeout,
        seed=options.seed,
        logprobs_mode="processed_logprobs"
        if options.logprobs_mode == "processed_logprobs"
        else "raw_logprobs",
        cache=CacheConfig(
            block_size=options.block_size,
            num_blocks=options.num_kv_blocks,
            memory_bytes=options.kv_cache_memory,
            enable_prefix_caching=not options.no_prefix_caching,
            hash_seed=options.prefix_caching_hash_seed,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_num_seqs=options.max_num_seqs,
            enable_chunked_prefill=not options.no_chunked_prefill,
            token_budget=token_budget_config(options),
            prefill_order="arrival" if options.prefill_order == "arrival" else "shortest",
            max_prefill_overtakes=options.max_prefill_overtakes,
        ),
    )


def token_budget_config(options: WorkerOptions) -> TokenBudgetConfig:
    """How the engine chooses each step's token budget, from the worker's options."""
    target_ms = options.target_itl_ms
    return TokenBudgetConfig(
        mode="adaptive" if options.token_budget == "adaptive" else "static",
        target_itl_s=None if target_ms is None else target_ms / 1000.0,
        min_budget=options.min_budget,
        max_budget=options.max_budget,
    )


def torch_threads(options: WorkerOptions) -> int | None:
    """The torch threads a worker computes with (None: torch's own choice).

    One by default on CPU: a worker shares the cores with the router, other workers
    and clients, and OpenMP threads that spin while others hold the cores make every
    step many times slower. Give --threads to use more."""
    if options.threads or options.device == "cpu":
        return options.threads or 1
    return None


def build_server(options: WorkerOptions, limits: RequestLimits) -> WorkerServer:
    """Load the model and tokenizer and assemble the server (not yet listening)."""
    import torch

    threads = torch_threads(options)
    if threads is not None:
        torch.set_num_threads(threads)
    token_file = options.internal_token_file
    credential = read_credential(token_file) if token_file is not None else None
    prefill_peers = PrefillAllowList(options.prefill_peer, options.prefill_peers_file)
    engine = LLMEngine(engine_config(options))
    weights = weights_digest(options.model)
    tokenizer = Tokenizer.from_dir(options.model)
    metrics = WorkerMetrics(options.pool, options.role, revision=options.revision)
    load = LoadTracker(engine, options.role, options.revision)
    async_engine = AsyncEngine(
        engine, [metrics, load], queue_timeout_s=options.queue_timeout,
        max_stream_buffer_tokens=options.max_stream_buffer_tokens,
        on_stream_overflow=metrics.observe_stream_overflow,
    )  # fmt: skip
    model = ServedModel(
        name=options.served_model_name or options.model.resolve().name,
        role=options.role,
        max_model_len=engine.max_model_len,
        path=str(options.model),
    )
    handoff, prefill = _handoff_sides(
        options, async_engine, metrics, model.name, weights, credential
    )
    admission = Admission(options.max_queued_requests, lambda: async_engine.num_queued)
    serving = OpenAIServing(
        async_engine, tokenizer, metrics, model, limits, admission, handoff,
        InternalAuth(credential, allow_direct_clients=options.allow_direct_clients),
        prefill_peers,
    )  # fmt: skip
    return WorkerServer(
        serving, limits.max_body_size, load, prefill, kv_feed(engine, model.name, weights)
    )


def kv_feed(engine: LLMEngine, model_name: str, weights: str) -> KVFeed:
    """The feed of the engine's prefix-cache events, for KV-aware routers."""
    events = KVEventLog()
    engine.kv_cache.pool.prefix_watcher = events
    identity = kv_identity(
        engine.block_size, engine.kv_cache.hash_seed, model_name, weights, engine.num_blocks
    )
    return KVFeed(events, identity)


def _handoff_sides(
    options: WorkerOptions,
    engine: AsyncEngine,
    metrics: WorkerMetrics,
    model_name: str,
    weights: str,
    credential: str | None,
) -> tuple[DecodeHandoff | None, PrefillService | None]:
    """The P/D hand-off side this worker's role plays, with its transfer agent."""
    if options.role == "both":
        return None, None
    # Imported here: a transfer backend (NIXL, UCX) loads only where it is used.
    from pdserve.workers.kv_transfer.factory import create_agent

    kv_cache = engine.engine.runner.kv_cache
    layout = KVLayout.of(kv_cache, model=model_name, weights=weights)
    agent = create_agent(
        options.kv_transfer,
        f"{options.role}-{uuid.uuid4().hex[:12]}",
        kv_cache,
        layout,
        host=options.kv_transfer_host or options.host,
    )
    log.info("KV transfer agent %s over weights %s", agent.name, layout.weights)
    if options.role == "prefill":
        return None, PrefillService(engine, agent, metrics, options.handoff_timeout)
    handoff = DecodeHandoff(
        engine, agent, metrics, options.transfer_failure_policy, options.handoff_timeout,
        headers=bearer(credential) if credential else None,
        room_wait_s=options.handoff_room_wait,
    )  # fmt: skip
    return handoff, None


async def warm_up(server: WorkerServer) -> None:
    """Run one short request so the first real one does not pay for lazy set-up."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, min(server.engine.engine.max_model_len - 2, 32) + 1))
    async for _ in server.engine.generate(prompt, params, request_id="warm-up"):
        pass


async def run_server(server: WorkerServer, options: WorkerOptions, network: NetworkLimits) -> None:
    """Serve until SIGINT/SIGTERM, then drain (see `drain`) and stop the engine."""
    server.engine.start()
    metrics = NetworkMetrics(server.metrics.registry, options.pool, options.role)
    guard = NetworkGuard(network, metrics)
    runner = web.AppRunner(server.app(guard), handler_cancellation=True, access_log=None)
    await runner.setup()
    with binding(options.host, options.port):
        port = await listen(runner, options.host, options.port, guard)
    if options.port_file is not None:
        announce_port(options.port_file, port)
    await warm_up(server)
    server.ready = True
    log.info("worker ready on http://%s:%d (model %s)", options.host, port, server.model.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.ready = False
    await server.drain.drain(options.drain_timeout)
    await runner.cleanup()
    if server.handoff is not None:
        await server.handoff.close()
    if server.prefill is not None:
        server.prefill.close()
    server.engine.stop()


def serve(options: WorkerOptions, limits: RequestLimits, network: NetworkLimits) -> int:
    """`pdserve worker`: returns the exit code."""
    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_port_free(options.host, options.port)  # before the model loads
        for name, part in installed_parts().items():
            log.info("%s %s from %s", name, part["version"], part["path"])
        server = build_server(options, limits)
    except (ConfigError, CredentialError, OSError, ValueError) as error:
        print(f"pdserve worker: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_server(server, options, network))
    except PortInUseError as error:  # taken since the check
        print(f"pdserve worker: {error}", file=sys.stderr)
        return 2
    return 0
