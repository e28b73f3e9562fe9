"""Assembling and running a worker: engine, tokenizer, metrics and HTTP server."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from pdserve.workers.engine.async_engine import AsyncEngine
from pdserve.workers.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
)
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.sampling import SamplingParams
from pdserve.workers.engine.tokenizer import Tokenizer
from pdserve.workers.handoff.decode import DecodeHandoff
from pdserve.workers.handoff.prefill import PrefillService
from pdserve.workers.kv_transfer.layout import KVLayout
from pdserve.workers.metrics import WorkerMetrics
from pdserve.workers.server import WorkerInfo, WorkerServer

log = logging.getLogger("pdserve.worker")


@dataclass(frozen=True)
class WorkerOptions:
    """The settings of `pdserve worker`."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 8000
    role: str = "both"
    pool: str = "local"
    served_model_name: str | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    no_chunked_prefill: bool = False
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    block_size: int = 16
    no_prefix_caching: bool = False
    max_model_len: int | None = None
    dtype: str | None = None
    device: str = "cpu"
    seed: int = 0
    threads: int | None = None
    log_level: str = "info"
    kv_cache_dtype: str | None = None
    kv_transfer: str = "nixl"
    transfer_failure_policy: str = "recompute"
    handoff_timeout: float = 30.0
    kv_transfer_host: str | None = None

    def engine_config(self) -> EngineConfig:
        """The engine's configuration."""
        return EngineConfig(
            model_dir=self.model,
            device=self.device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=self.max_model_len,
            handoff_lease_s=self.handoff_timeout,
            seed=self.seed,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                memory_bytes=self.kv_cache_memory,
                enable_prefix_caching=not self.no_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=not self.no_chunked_prefill,
            ),
        )


def build_server(options: WorkerOptions) -> WorkerServer:
    """Load the model and tokenizer and assemble the server (not yet listening)."""
    import torch

    # One thread by default on CPU: a worker shares the cores with the router, other
    # workers and clients, and OpenMP threads that spin while others hold the cores
    # make every step many times slower. Give --threads to use more.
    if options.threads or options.device == "cpu":
        torch.set_num_threads(options.threads or 1)
    engine = LLMEngine(options.engine_config())
    tokenizer = Tokenizer.from_dir(options.model)
    metrics = WorkerMetrics(options.pool, options.role)
    async_engine = AsyncEngine(engine, observers=[metrics])
    info = WorkerInfo(
        model_name=options.served_model_name or options.model.resolve().name,
        role=options.role,
        max_model_len=engine.max_model_len,
    )
    handoff, prefill = _handoff_sides(options, async_engine, metrics, info.model_name)
    return WorkerServer(async_engine, tokenizer, metrics, info, handoff, prefill)


def _handoff_sides(
    options: WorkerOptions, engine: AsyncEngine, metrics: WorkerMetrics, model_name: str
) -> tuple[DecodeHandoff | None, PrefillService | None]:
    """The P/D hand-off side this worker's role plays, with its transfer agent."""
    if options.role == "both":
        return None, None
    # Imported here: a transfer backend (NIXL, UCX) loads only where it is used.
    from pdserve.workers.kv_transfer.factory import create_agent

    kv_cache = engine.engine.runner.kv_cache
    agent = create_agent(
        options.kv_transfer,
        f"{options.role}-{uuid.uuid4().hex[:12]}",
        kv_cache,
        KVLayout.of(kv_cache, model=model_name),
        host=options.kv_transfer_host or options.host,
    )
    if options.role == "prefill":
        return None, PrefillService(engine, agent, metrics, options.handoff_timeout)
    handoff = DecodeHandoff(
        engine, agent, metrics, options.transfer_failure_policy, options.handoff_timeout
    )
    return handoff, None


async def warm_up(server: WorkerServer) -> None:
    """Run one short request so the first real one does not pay for lazy set-up."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, min(server.info.max_model_len - 2, 32) + 1))
    async for _ in server.engine.generate(prompt, params, request_id="warm-up"):
        pass


async def run_server(server: WorkerServer, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM, then stop the engine."""
    server.engine.start()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    await warm_up(server)
    server.ready = True
    log.info("worker ready on http://%s:%d (model %s)", host, port, server.info.model_name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.ready = False
    await runner.cleanup()
    if server.handoff is not None:
        await server.handoff.close()
    server.engine.stop()


def serve(options: WorkerOptions) -> int:
    """`pdserve worker`: returns the exit code."""
    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        server = build_server(options)
    except (ConfigError, OSError, ValueError) as error:
        print(f"pdserve worker: {error}", file=sys.stderr)
        return 2
    asyncio.run(run_server(server, options.host, options.port))
    return 0
