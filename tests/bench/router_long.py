"""The router's CPU per request on the KV-routing bench's long prompts, in one process
through the fake transports of `router_harness`: the Mooncake replay's prompt text
(blocks of its words, a shared prefix and a new last block per request), KV-aware
scoring on, the pool's credential held (the prompt's ids go to the worker), 32
tokens streamed back.

    python tests/bench/router_long.py cpu [--blocks N] [--requests N]
    python tests/bench/router_long.py profile [--blocks N] [--requests N]  # cProfile

Not a test (not in `make test`, no assertion on time).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parent)]

import orjson  # noqa: E402
import router_harness as harness  # noqa: E402

from pdserve.workers.bench.prefix_workloads import (  # noqa: E402
    TOKENS_PER_WORD,
    TRACE_BLOCK_TOKENS,
    _block,
)
from pdserve.workers.network.http1 import Http1Server  # noqa: E402

LENGTH_SCALE = 1 / 8  # the Mooncake replay's (test_kv_routing.MOONCAKE_LENGTH_SCALE)
WORDS = max(1, round(TRACE_BLOCK_TOKENS * LENGTH_SCALE / TOKENS_PER_WORD))
NUMBERS = itertools.count()


def table_bytes(model_dir: Path) -> bytes:
    table = {
        "pool": "kv",
        "model": {"name": "small", "path": str(model_dir)},
        "buckets": [{"mode": "colocated"}],
        "routingPolicy": {"type": "kv-aware", "blockSize": 16},
        "discovery": {"kind": "static", "decode": [harness.UPSTREAM]},
    }
    return json.dumps(table).encode()


def build(model_dir: Path) -> Http1Server:
    """The router as `main.run_router` assembles it, KV-aware, holding a credential."""
    server: Http1Server
    server, feeds = harness.assemble(table_bytes(model_dir), credential="credential")
    feeds.track("decode", [harness.UPSTREAM])
    return server


NEW = 1  # blocks of its own per request (the rest shared by all)


def prompt(blocks: int) -> str:
    """A shared prefix of `blocks - NEW` blocks and `NEW` blocks of its own."""
    shared = "".join(_block(0, block, WORDS) for block in range(blocks - NEW))
    number = next(NUMBERS)
    return shared + "".join(_block(1, number * 1000 + n, WORDS) for n in range(NEW))


def request_bytes(blocks: int) -> bytes:
    body = orjson.dumps(
        {"model": "small", "prompt": prompt(blocks), "max_tokens": 32, "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}}
    )  # fmt: skip
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nUser-Agent: Python/3.11 aiohttp/3.11\r\n"
        b"Content-Length: %d\r\nContent-Type: application/json\r\n\r\n%s" % (len(body), body)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("mode", choices=("cpu", "profile"))
    parser.add_argument("--blocks", type=int, default=70, help="trace blocks (~43 tokens each)")
    parser.add_argument("--new", type=int, default=1, help="blocks of its own per request")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--each", action="store_true", help="a read per worker write")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--top", type=int, default=40)
    options = parser.parse_args()
    model_dir = options.model_dir
    if model_dir is None:
        from pdserve.cli.demo import DEFAULT_MODEL_DIR, ensure_tiny_model

        ensure_tiny_model(DEFAULT_MODEL_DIR)
        model_dir = DEFAULT_MODEL_DIR
    global NEW
    NEW = options.new
    pieces = harness.worker_answer(32)
    answer = pieces if options.each else [b"".join(pieces)]
    harness.request_bytes = lambda: request_bytes(options.blocks)
    sample = request_bytes(options.blocks)
    print(f"request of {len(sample)} bytes")

    async def drive(server: Http1Server, requests: int) -> float:
        """CPU seconds of the requests alone (the bodies made beforehand)."""
        bodies = [request_bytes(options.blocks) for _ in range(requests)]
        feed = iter(bodies)
        harness.request_bytes = lambda: next(feed)
        start = time.process_time()
        written = await harness.drive(server, requests)
        spent = time.process_time() - start
        assert b"[DONE]" in b"".join(written), written
        return spent

    with asyncio.Runner(loop_factory=lambda: harness.fake_worker_loop(answer)) as runner:

        async def built() -> Http1Server:
            return build(model_dir)

        server = runner.run(built())
        gc.freeze()
        runner.run(drive(server, options.warmup))
        if options.mode == "cpu":
            rounds = [
                runner.run(drive(server, options.requests)) / options.requests * 1e3
                for _ in range(options.rounds)
            ]
            print(f"CPU ms/request (process), rounds: {' '.join(f'{r:.2f}' for r in rounds)}; "
                  f"min {min(rounds):.2f}")  # fmt: skip
        else:
            import cProfile
            import pstats

            bodies = [request_bytes(options.blocks) for _ in range(options.requests)]
            feed = iter(bodies)
            harness.request_bytes = lambda: next(feed)
            profiler = cProfile.Profile()
            profiler.runcall(runner.run, harness.drive(server, options.requests))
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(options.top)
            stats.sort_stats("cumulative").print_stats(options.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
