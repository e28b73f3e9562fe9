"""Polling the workers' /load: the router's view of each worker's load, and its
liveness probe. A worker that cannot be reached, answers 5xx, or does not answer in
time and answered nothing else meanwhile counts as a failure for its circuit breaker;
an answer closes a breaker whose cooldown has run out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import aiohttp

from pdserve.workers.router.workers import Worker, WorkerSet

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 1.0


class LoadPoller:
    """Reads every known worker's /load twice a second."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        sets: Iterable[WorkerSet],
        interval_s: float = POLL_INTERVAL_S,
        timeout_s: float = POLL_TIMEOUT_S,
    ) -> None:
        self._session = session
        self._sets = list(sets)
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            workers = [worker for workers in self._sets for worker in workers]
            started = time.monotonic()
            await asyncio.gather(*(self.poll(worker) for worker in workers))
            await asyncio.sleep(max(0.0, self._interval_s - (time.monotonic() - started)))

    async def poll(self, worker: Worker) -> None:
        """Read one worker's load; record the outcome on its breaker."""
        answers = worker.breaker.answers
        try:
            async with self._session.get(f"{worker.url}/load", timeout=self._timeout) as response:
                body = None
                if response.status == 200:
                    with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                        body = await response.json()
                status = response.status
        except TimeoutError as error:
            # A worker busy enough to answer its probe late while it answers requests
            # is slow, not down: opening its breaker would turn its load away to
            # nobody (with one decode worker, every request refused).
            if worker.breaker.answers == answers:
                _probe_failed(worker, error)
            return
        except (aiohttp.ClientError, OSError) as error:
            _probe_failed(worker, error)
            return
        if status >= 500:
            worker.breaker.failed()
            return
        # A server without /load (404) is alive; it just publishes no load.
        worker.read(body, time.monotonic())
        worker.breaker.succeeded()


def _probe_failed(worker: Worker, error: BaseException) -> None:
    if worker.breaker.state == "closed":
        log.debug("load probe of %s failed: %r", worker.url, error)
    worker.breaker.failed()
