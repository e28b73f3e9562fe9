"""Assembling and running a worker: engine, tokenizer, metrics and HTTP server."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
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

    def engine_config(self) -> EngineConfig:
        """The engine's configuration."""
        return EngineConfig(
            model_dir=self.model,
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
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
    return WorkerServer(async_engine, tokenizer, metrics, info)


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
    server.engine.stop()


def serve(options: WorkerOptions) -> int:
    """`pdserve worker`: returns the exit code."""
    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        server = build_server(options)
    except (ConfigError, OSError) as error:
        print(f"pdserve worker: {error}", file=sys.stderr)
        return 2
    asyncio.run(run_server(server, options.host, options.port))
    return 0
