"""Prefill workers that misbehave, for a real decode worker to face: one that accepts
connections and never answers, and one that answers whatever a test scripts. Each
runs on an event loop of its own in a thread, on a port the system picks at bind."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any

from aiohttp import web

from support.network import serving

# What the scripted peer answers to /pd/prefill: (status, JSON body), given the
# request's body and the decode worker's KV layout (from /pd/connect).
Script = Callable[[dict[str, Any], dict[str, Any]], tuple[int, Any]]


@contextmanager
def _in_a_thread(serve: Callable[[], AbstractAsyncContextManager[str]]) -> Iterator[str]:
    """Run the server `serve()` makes on a loop of its own until the block ends; its URL."""
    urls: queue.Queue[str] = queue.Queue()
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        stop = asyncio.Event()
        running.append((asyncio.get_running_loop(), stop))
        async with serve() as url:
            urls.put(url)
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    url = urls.get(timeout=30)
    try:
        yield url
    finally:
        loop, stop = running[0]
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)


@asynccontextmanager
async def silent_server(accepted: list[str] | None = None) -> AsyncIterator[str]:
    """On the running loop: the URL of a server that accepts, reads, never answers;
    the peer address of each connection it accepts is added to `accepted`."""
    connections: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        if accepted is not None:
            accepted.append(str(writer.get_extra_info("peername")))
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in connections:
            writer.close()


@contextmanager
def silent_peer(accepted: list[str] | None = None) -> Iterator[str]:
    """The URL of a server that accepts connections, reads, and never answers (each
    connection's peer address added to `accepted`)."""
    with _in_a_thread(lambda: silent_server(accepted)) as url:
        yield url


@contextmanager
def scripted_peer(script: Script) -> Iterator[str]:
    """The URL of a prefill worker that meets any decode worker (echoing its layout)
    and answers each /pd/prefill as `script` says."""
    layouts: dict[str, dict[str, Any]] = {}

    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def connect(request: web.Request) -> web.Response:
        body = await request.json()
        layouts[body["peer"]] = body["metadata"]["layout"]
        return web.json_response({"metadata": {"layout": body["metadata"]["layout"]}})

    async def prefill(request: web.Request) -> web.Response:
        body = await request.json()
        status, answer = script(body, layouts[body["peer"]])
        # json.dumps writes NaN and Infinity, as a careless peer would.
        return web.json_response(answer, status=status)

    async def cancel(_: web.Request) -> web.Response:
        return web.json_response({"stopped": True})

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_post("/pd/connect", connect)
    app.router.add_post("/pd/prefill", prefill)
    app.router.add_post("/pd/cancel", cancel)
    with _in_a_thread(lambda: serving(app)) as url:
        yield url


def consistent_answer(body: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """An answer that agrees with the hand-off asked for in every field (first token
    5 for each choice), as if the prefill worker had written the blocks."""
    blocks = len(body["block_ids"])
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[layout["dtype"]]
    block_bytes = 2 * layout["block_size"] * layout["num_kv_heads"] * layout["head_dim"] * itemsize
    return {
        "first_tokens": [5] * body["sampling"]["n"],
        "blocks": blocks,
        "bytes": blocks * layout["num_layers"] * block_bytes,
        "transfer_seconds": 0.001,
        "descriptors": layout["num_layers"],
        "prefill_seconds": 0.01,
    }
