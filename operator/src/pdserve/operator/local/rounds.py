"""Rounds of a local pool's control loops (the planner's, the rollouts'): a coroutine
run every interval in a thread of its own, with an event loop and an HTTP session for
its Prometheus queries, until stopped. Starting or stopping workers blocks that thread
only; a round that raises is logged and the rounds go on."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

import aiohttp

log = logging.getLogger(__name__)

Round = Callable[[aiohttp.ClientSession], Awaitable[None]]


class Rounds:
    """`round` every `interval_s` seconds (read before each wait), in a thread."""

    def __init__(self, name: str, round_: Round, interval_s: Callable[[], float]) -> None:
        self.name = name
        self._round = round_
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the rounds in a thread of their own."""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the round under way (a worker starting or draining finishes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            asyncio.run(self._rounds())
        except Exception:
            log.exception("%s stopped", self.name)

    async def _rounds(self) -> None:
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                try:
                    await self._round(session)
                except Exception:  # a bug must not end the loop
                    log.exception("%s round", self.name)
                await asyncio.to_thread(self._stop.wait, self._interval_s())
