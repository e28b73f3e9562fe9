"""The asyncio front of the engine: the step loop runs in its own thread (torch
releases the GIL while it computes), and each request's outputs reach its coroutine
through an asyncio queue.

Every call into the engine core happens on the engine thread; coroutines only post
commands. A request whose consumer goes away (client disconnect, cancellation) is
aborted, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.sampling import SamplingParams
from pdserve.workers.engine.stats import RequestOutput

log = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """Receives every step's results on the engine thread (metrics, logs)."""

    def on_step(self, result: StepResult) -> None:
        """Called after each step; must be quick and must not raise."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Callable[[RequestOutput | BaseException], None]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Serves requests from coroutines with an LLMEngine on a background thread."""

    def __init__(self, engine: LLMEngine, observers: Sequence[EngineObserver] = ()) -> None:
        self.engine = engine
        self.observers = list(observers)
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._error: BaseException | None = None
        self._stopping = False

    def start(self) -> None:
        """Start the step loop."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the step loop (pending requests get an error)."""
        self._stopping = True
        self._commands.put(None)
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        """False once the step loop died."""
        return self._error is None and self._thread.is_alive()

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate (raising InvalidRequestError at once), queue, and yield outputs
        until the request finishes. Leaving the iteration early aborts it."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        self.engine.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        self._post(_Add(request_id, list(prompt_token_ids), params, sink))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._post(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if it already ended)."""
        self._post(_Abort(request_id))

    def _post(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                if self._drain_commands() and not self.engine.has_unfinished():
                    self._deliver(self.engine.snapshot())  # e.g. an abort freed blocks
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as error:  # the loop must report, not vanish
            log.exception("engine step loop failed")
            self._error = error
            for sink in self._sinks.values():
                sink(EngineDeadError(f"the engine stopped: {error}"))
            self._sinks.clear()

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts; True if there were any."""
        applied = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return applied
            if command is None:
                return applied
            applied = True
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._abort(command.request_id)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as error:
            command.sink(error)
            return
        self._sinks[command.request_id] = command.sink

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        sink = self._sinks.pop(request_id, None)
        if output is not None and sink is not None:
            sink(output)

    def _deliver(self, result: StepResult) -> None:
        for output in result.outputs:
            sink = self._sinks.get(output.request_id)
            if sink is not None:
                sink(output)
            if output.finished:
                self._sinks.pop(output.request_id, None)
        for observer in self.observers:
            try:
                observer.on_step(result)
            except Exception:  # metrics must never stop serving
                log.exception("engine observer failed")
