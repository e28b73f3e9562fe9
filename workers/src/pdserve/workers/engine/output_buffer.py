"""The outputs of one request on their way from the engine thread to the coroutine
that consumes them, bounded.

A consumer that stops taking outputs (a streaming client that does not read: the
server's write waits on a full socket) must not make the worker hold the tokens the
engine goes on producing for it. Past `max_tokens` generated tokens waiting, the
buffer drops what it holds, calls `on_overflow` (which aborts the request, freeing
its KV blocks at once, and counts it) and hands the consumer a `StreamOverflowError`
when it comes back. Aborting rather than pausing: a paused request would keep its KV
blocks and its seat in the batch for as long as its client likes, which is the cost
a slow reader must not put on the others."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdserve.workers.engine.stats import RequestOutput


class StreamOverflowError(RuntimeError):
    """A request's consumer left more tokens waiting than the buffer holds; the request
    was aborted."""


class OutputBuffer:
    """A queue of one request's outputs holding at most `max_tokens` generated tokens
    (None: unbounded). `put` and `get` run on the event loop's thread."""

    def __init__(self, max_tokens: int | None, on_overflow: Callable[[], None]) -> None:
        self.max_tokens = max_tokens
        self._on_overflow = on_overflow
        self._items: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.tokens = 0  # generated tokens waiting
        self.overflowed = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output (or the error that ends the request)."""
        if self.overflowed:
            return
        if isinstance(item, RequestOutput):
            self.tokens += len(item.new_token_ids)
            if self.max_tokens is not None and self.tokens > self.max_tokens:
                self._overflow()
                return
        self._items.put_nowait(item)

    async def get(self) -> RequestOutput | BaseException:
        """The next output, waiting for one."""
        item = await self._items.get()
        if isinstance(item, RequestOutput):
            self.tokens -= len(item.new_token_ids)
        return item

    def _overflow(self) -> None:
        self.overflowed = True
        while not self._items.empty():
            self._items.get_nowait()
        self.tokens = 0
        self._items.put_nowait(
            StreamOverflowError(
                f"more than {self.max_tokens} tokens of this request waited to be sent (the "
                "client did not take them as fast as they came): the request was aborted"
            )
        )
        self._on_overflow()
