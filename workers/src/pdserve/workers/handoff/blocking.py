"""Threads for the transfer agent's blocking calls, apart from asyncio's default pool.

Meeting a peer may block for a whole timeout when the peer never comes (torch's
rendezvous); moving data blocks only as long as a transfer takes. Each kind gets a
bounded pool of its own, so that many unreachable peers tie up at most the meeting
threads, never those that hand-offs to live peers need, nor the default pool that
the rest of the worker shares.

Every call has a deadline. It is given the seconds left when it starts on a thread
(not when it was queued), and fails (TransferError) if none are; a call still queued
at its deadline is withdrawn. A call that has started is always awaited to its end,
which its own timeout bounds: its caller must not act (free blocks) while it runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.workers.kv_transfer.base import TransferError, seconds_left

Result = TypeVar("Result")

MEET_THREADS = 4
MOVE_THREADS = 16


class BlockingCalls:
    """Two bounded thread pools: `meet` (connections) and `move` (transfers)."""

    def __init__(self, meet_threads: int = MEET_THREADS, move_threads: int = MOVE_THREADS) -> None:
        self._meet = ThreadPoolExecutor(meet_threads, thread_name_prefix="kv-meet")
        self._move = ThreadPoolExecutor(move_threads, thread_name_prefix="kv-move")

    async def meet(self, deadline: float, call: Callable[[float], Result]) -> Result:
        """`call(seconds left)` on a meeting thread (accept, connect, disconnect)."""
        return await _run(self._meet, deadline, call)

    async def move(self, deadline: float, call: Callable[[float], Result]) -> Result:
        """`call(seconds left)` on a transfer thread (write, decline, wait, withdraw)."""
        return await _run(self._move, deadline, call)

    def close(self) -> None:
        """Stop taking calls; queued ones are dropped, running ones finish."""
        self._meet.shutdown(wait=False, cancel_futures=True)
        self._move.shutdown(wait=False, cancel_futures=True)


async def _run(
    pool: ThreadPoolExecutor, deadline: float, call: Callable[[float], Result]
) -> Result:
    what = getattr(call, "__name__", "a blocking call")

    def on_thread() -> Result:
        return call(seconds_left(deadline, what))

    started = pool.submit(on_thread)
    result = asyncio.wrap_future(started)
    try:
        return await asyncio.wait_for(asyncio.shield(result), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        if started.cancel():  # still queued: withdrawn
            raise TransferError(f"{what}: no thread was free before its deadline") from None
        return await result  # running: its own timeout ends it
    except asyncio.CancelledError:
        started.cancel()  # withdrawn if still queued; a running call ends on its own
        raise
