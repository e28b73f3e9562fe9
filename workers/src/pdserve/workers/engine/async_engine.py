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
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.sampling import SamplingParams
from pdserve.workers.engine.stats import RequestOutput

log = logging.getLogger(__name__)
Result = TypeVar("Result")


class EngineObserver(Protocol):
    """Receives every step's results on the engine thread (metrics, logs)."""

    def on_step(self, result: StepResult) -> None:
        """Called after each step; must be quick and must not raise."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served."""


Sink = Callable[[RequestOutput | BaseException], None]
# Puts a request into the engine (on the engine thread); may return a first output.
Admit = Callable[[LLMEngine], RequestOutput | None]


@dataclass
class _Admit:
    request_id: str
    admit: Admit
    sink: Sink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    function: Callable[[LLMEngine], Any]
    done: Callable[[Any, BaseException | None], None]


class AsyncEngine:
    """Serves requests from coroutines with an LLMEngine on a background thread."""

    def __init__(self, engine: LLMEngine, observers: Sequence[EngineObserver] = ()) -> None:
        self.engine = engine
        self.observers = list(observers)
        self._commands: queue.SimpleQueue[_Admit | _Abort | _Call | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
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
        if self.engine.canary is not None and not self._thread.is_alive():
            self.engine.canary.sweep()  # a last look at the blocks left free

    @property
    def healthy(self) -> bool:
        """False once the step loop died."""
        return self._error is None and self._thread.is_alive()

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        hold_blocks: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate (raising InvalidRequestError at once), queue, and yield outputs
        until the request finishes. Leaving the iteration early aborts it."""
        self.engine.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        prompt = list(prompt_token_ids)

        def admit(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, hold_blocks=hold_blocks)

        async for output in self.stream(request_id, admit):
            yield output

    async def stream(self, request_id: str, admit: Admit) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of a request that `admit` puts into the engine (on the engine
        thread), until it finishes. Leaving the iteration early aborts it."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        self._post(_Admit(request_id, admit, sink))
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

    async def call(self, function: Callable[[LLMEngine], Result]) -> Result:
        """Run `function(engine)` on the engine thread; its result or exception."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def done(result: Any, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(settle, result, error)

        self._post(_Call(function, done))
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if it already ended)."""
        self._post(_Abort(request_id))

    def _post(self, command: _Admit | _Abort | _Call) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                changed = self._drain_commands() + self.engine.expire_leases()
                if changed and not self.engine.has_unfinished():
                    self._deliver(self.engine.snapshot())  # e.g. an abort freed blocks
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=self._idle_wait())
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as error:  # the loop must report, not vanish
            log.exception("engine step loop failed")
            self._error = error
            for sink in self._sinks.values():
                sink(EngineDeadError(f"the engine stopped: {error}"))
            self._sinks.clear()

    def _idle_wait(self) -> float:
        """Seconds to sleep while idle: until the next lease deadline, at most 1 s."""
        deadline = self.engine.leases.next_deadline()
        if deadline is None:
            return 1.0
        remaining = max(0.0, float(deadline) - time.monotonic())
        return min(1.0, remaining + 0.001)

    def _drain_commands(self) -> int:
        """Apply queued commands; how many there were."""
        applied = 0
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return applied
            if command is None:
                return applied
            applied += 1
            if isinstance(command, _Admit):
                self._admit(command)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                self._abort(command.request_id)

    def _admit(self, command: _Admit) -> None:
        try:
            first = command.admit(self.engine)
        except (ValueError, LookupError) as error:
            command.sink(error)
            return
        if first is None or not first.finished:
            self._sinks[command.request_id] = command.sink
        if first is not None:
            command.sink(first)

    def _call(self, command: _Call) -> None:
        try:
            result = command.function(self.engine)
        except Exception as error:
            command.done(None, error)
            return
        command.done(result, None)

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
