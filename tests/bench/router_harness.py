"""The router's request path in one process, driven through fake transports: counts
that do not move with the machine's load, for comparing changes to the router.

The real router (`RouterServer`, its routes, forwarder, upstream client and HTTP/1.1
server) answers the request of `test_router_overhead` (a 17-word text prompt, 4
tokens streamed): the client's bytes are fed to a server connection whose transport
keeps what is written, and the worker's answer (as the fake server writes it) is fed
to the upstream connection in one read (as it arrives under load), or with `--each`
a read per write, one per loop iteration. No socket, no other process.

    python tests/bench/router_harness.py cpu [--requests N]
    python tests/bench/router_harness.py opcodes [--requests N]  # and the top functions
    python tests/bench/router_harness.py profile [--requests N]  # cProfile
    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=sys_call_tracing \
        python tests/bench/router_harness.py run --requests N       # instructions, N requests

Not a test (not in `make test`, no assertion on time).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parent)]

import orjson  # noqa: E402

from pdserve.operator import render  # noqa: E402
from pdserve.protocol.limits import Admission, RequestLimits  # noqa: E402
from pdserve.protocol.routing import parse_table  # noqa: E402
from pdserve.workers.network.guard import NetworkGuard  # noqa: E402
from pdserve.workers.network.http1 import Http1Connection, Http1Server  # noqa: E402
from pdserve.workers.network.limits import NetworkLimits  # noqa: E402
from pdserve.workers.network.metrics import NetworkMetrics  # noqa: E402
from pdserve.workers.router.app import RouterServer  # noqa: E402
from pdserve.workers.router.auth import ApiKeys  # noqa: E402
from pdserve.workers.router.kv_metrics import KVRoutingMetrics  # noqa: E402
from pdserve.workers.router.kv_scoring import KVScorer  # noqa: E402
from pdserve.workers.router.kv_subscriber import Expected, KVFeeds  # noqa: E402
from pdserve.workers.router.metrics import ROLE, RouterMetrics  # noqa: E402
from pdserve.workers.router.proxy import Forwarder  # noqa: E402
from pdserve.workers.router.upstream import Upstreams  # noqa: E402
from pdserve.workers.router.workers import WorkerSet  # noqa: E402

UPSTREAM = "http://127.0.0.1:9"
PROMPT = "the quick brown fox jumps over the lazy dog while a cat sleeps on the warm mat"


def _event(body: dict[str, Any]) -> bytes:
    data = b"data: " + json.dumps(body).encode() + b"\n\n"  # as the fake server writes it
    return b"%x\r\n%s\r\n" % (len(data), data)


def worker_answer(tokens: int = 4) -> list[bytes]:
    """The fake server's streamed answer, as its writes go out."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"Date: Thu, 03 Dec 2026 11:00:00 GMT\r\nServer: Python/3.11 aiohttp/3.11\r\n\r\n"
    )
    pieces = [head]
    for sent in range(1, tokens + 1):
        choice = {"index": 0, "text": " x", "finish_reason": "length" if sent == tokens else None}
        pieces.append(_event({"object": "text_completion", "choices": [choice]}))
    usage = {"prompt_tokens": 18, "completion_tokens": tokens, "total_tokens": 18 + tokens}
    pieces.append(_event({"choices": [], "usage": usage}))
    pieces.append(b"e\r\ndata: [DONE]\n\n\r\n")
    pieces.append(b"0\r\n\r\n")
    return pieces


class _Transport:
    """What both connections' protocols call on their transports."""

    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class WorkerTransport(_Transport):
    """A worker that answers every request with `answer`, a read per loop iteration."""

    def __init__(self, protocol: asyncio.Protocol, answer: list[bytes]) -> None:
        super().__init__()
        self.protocol = protocol
        self.answer = answer
        self.loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        pieces = iter(self.answer)

        def next_read() -> None:
            piece = next(pieces, None)
            if piece is not None and not self.closing:
                self.protocol.data_received(piece)
                self.loop.call_soon(next_read)

        self.loop.call_soon(next_read)


class ClientTransport(_Transport):
    """A client's connection: what the server writes, and the end of each answer."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.done: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.written.append(data)
        if data.endswith(b"0\r\n\r\n") and self.done is not None:
            self.done.set_result(None)


def routing_table_bytes(model_dir: Path) -> bytes:
    import test_router_overhead as bench

    pool = bench.colocated_pool(model_dir)
    table = render.routing_table("o", "local", pool.spec, {"kind": "static", "decode": [UPSTREAM]})
    return render.routing_json(table).encode()


def build(model_dir: Path, answer: list[bytes]) -> Http1Server:
    """The router as `main.run_router` assembles it, its worker known, its upstream fake."""
    server, _ = assemble(routing_table_bytes(model_dir), credential=None)
    return server


def assemble(table_bytes: bytes, credential: str | None) -> tuple[Http1Server, KVFeeds]:
    """The router as `main.run_router` assembles it from `table_bytes`, holding
    `credential` (the ids then go to the worker in the body), its decode worker known;
    and its KV feeds."""
    from pdserve.workers.engine.kv_events import seed_fingerprint
    from pdserve.workers.model.tokenizer import Tokenizer

    table = parse_table(table_bytes, "routing.json")
    tokenizer = Tokenizer.from_dir(table.model.path)
    metrics = RouterMetrics(table.pool)
    guard = NetworkGuard(NetworkLimits(), NetworkMetrics(metrics.registry, metrics.pool, ROLE))
    policy = table.routing_policy
    expected = Expected(
        policy.block_size, table.model.name, hash_seed=seed_fingerprint(policy.hash_seed)
    )
    feeds = KVFeeds(None, {}, expected, KVRoutingMetrics(metrics.pool, metrics.registry))  # type: ignore[arg-type]
    forwarder = Forwarder(
        Upstreams(3.0), WorkerSet("prefill"), WorkerSet("decode"), credential, metrics, 3,
        KVScorer(feeds, feeds.metrics),
    )  # fmt: skip
    limits = RequestLimits()
    admission = Admission(4096, lambda: forwarder.awaiting_first_token)
    server = RouterServer(
        table, table_bytes, tokenizer, forwarder, limits, admission, ApiKeys(None), None, feeds
    )
    server.sets["decode"].update([UPSTREAM])
    server.ready = True
    return Http1Server(server.routes(), guard, limits.max_body_size), feeds


def fake_worker_loop(answer: list[bytes]) -> asyncio.AbstractEventLoop:
    """uvloop's loop whose connections to workers reach a fake worker answering
    `answer` (the upstream client's own classes untouched: they may be compiled)."""
    import uvloop

    class Loop(uvloop.Loop):
        async def create_connection(  # type: ignore[override]
            self, factory: Any, *args: Any, **kwargs: Any
        ) -> Any:
            protocol = factory()
            transport = WorkerTransport(protocol, answer)
            protocol.connection_made(transport)
            return transport, protocol

    return Loop()


NUMBERS = itertools.count()


def request_bytes() -> bytes:
    body = orjson.dumps(
        {"prompt": f"{PROMPT} {next(NUMBERS)}", "max_tokens": 4, "ignore_eos": True,
         "stream": True}
    )  # fmt: skip
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nUser-Agent: Python/3.11 aiohttp/3.11\r\n"
        b"Content-Length: %d\r\nContent-Type: application/json\r\n\r\n%s" % (len(body), body)
    )


async def drive(
    server: Http1Server, requests: int, between: Callable[[int], None] | None = None
) -> list[bytes]:
    """Send `requests` requests one after another on one connection; the last answer."""
    loop = asyncio.get_running_loop()
    client = ClientTransport()
    connection = Http1Connection(server)
    connection.connection_made(client)  # type: ignore[arg-type]
    for number in range(requests):
        if between is not None:
            between(number)
        client.written.clear()
        client.done = loop.create_future()
        connection.data_received(request_bytes())
        await client.done
    return list(client.written)


def run(model_dir: Path, warmup: int, requests: int, mode: str, each: bool, top: int = 40) -> None:
    # Under load the worker's whole answer reaches the router in one read (strace: about
    # two reads per request, the client's and the worker's); `each`: a read per write.
    answer = worker_answer() if each else [b"".join(worker_answer())]

    async def warm() -> Http1Server:
        server = build(model_dir, answer)
        gc.freeze()  # as `main.run_router` does before serving
        written = await drive(server, warmup)
        assert b"[DONE]" in b"".join(written), written
        return server

    async def cpu(server: Http1Server) -> None:
        rounds = []
        for _ in range(5):
            start = time.thread_time()
            await drive(server, requests)
            rounds.append((time.thread_time() - start) / requests * 1e6)
        print(f"CPU us/request, 5 rounds: {' '.join(f'{r:.1f}' for r in rounds)}; "
              f"min {min(rounds):.1f}")  # fmt: skip

    async def opcodes(server: Http1Server) -> None:
        counts: collections.Counter[str] = collections.Counter()

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            frame.f_trace_opcodes = True
            code = frame.f_code
            name = f"{Path(code.co_filename).name}:{code.co_firstlineno}:{code.co_name}"

            def local(frame: Any, event: str, arg: Any) -> Any:
                if event == "opcode":
                    counts[name] += 1
                return local

            return local

        sys.settrace(tracer)
        await drive(server, requests)
        sys.settrace(None)
        total = sum(counts.values())
        print(f"opcodes per request: {total / requests:.1f}")
        for name, count in counts.most_common(top):
            print(f"  {count / requests:8.1f}  {name}")

    with asyncio.Runner(loop_factory=lambda: fake_worker_loop(answer)) as runner:
        server = runner.run(warm())
        if mode == "cpu":
            runner.run(cpu(server))
        elif mode == "opcodes":
            runner.run(opcodes(server))
        elif mode == "profile":
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(runner.run, drive(server, requests))
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(top)
            stats.sort_stats("cumulative").print_stats(top)
        else:
            # The requests alone, inside a C function of their own: under callgrind,
            # `--collect-atstart=no --toggle-collect=sys_call_tracing` counts them only.
            sys.call_tracing(runner.run, (drive(server, requests),))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("mode", choices=("cpu", "opcodes", "profile", "run"))
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--top", type=int, default=40, help="functions listed (opcodes)")
    parser.add_argument(
        "--each", action="store_true", help="the worker's answer in a read per write"
    )
    options = parser.parse_args()
    model_dir = options.model_dir
    if model_dir is None:
        from pdserve.cli.demo import DEFAULT_MODEL_DIR, ensure_tiny_model

        ensure_tiny_model(DEFAULT_MODEL_DIR)
        model_dir = DEFAULT_MODEL_DIR
    run(model_dir, options.warmup, options.requests, options.mode, options.each, options.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
