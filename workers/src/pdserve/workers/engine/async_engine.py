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

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers import faults
from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.isolation import is_engine_fault
from pdserve.workers.engine.output_buffer import OutputBuffer
from pdserve.workers.engine.stats import RequestOutput

log = logging.getLogger(__name__)
Result = TypeVar("Result")


class EngineObserver(Protocol):
    """Receives every step's results on the engine thread (metrics, logs)."""

    def on_step(self, result: StepResult) -> None:
        """Called after each step; must be quick and must not raise."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served."""


class QueueTimeoutError(RuntimeError):
    """A request waited longer than the queue's deadline for its first step."""


Sink = Callable[[RequestOutput | BaseException], None]
# Puts a request into the engine (on the engine thread); may return first outputs.
Admit = Callable[[LLMEngine], list[RequestOutput]]


@dataclass
class _Admit:
    request_id: str
    admit: Admit
    sink: Sink


@dataclass
class _Abort:
    request_id: str
    index: int | None = None  # one choice of a request with n > 1


@dataclass
class _Call:
    function: Callable[[LLMEngine], Any]
    done: Callable[[Any, BaseException | None], None]


class AsyncEngine:
    """Serves requests from coroutines with an LLMEngine on a background thread."""

    def __init__(
        self,
        engine: LLMEngine,
        observers: Sequence[EngineObserver] = (),
        queue_timeout_s: float | None = None,
        max_stream_buffer_tokens: int | None = None,
        on_stream_overflow: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.observers = list(observers)
        self.queue_timeout_s = queue_timeout_s
        # Generated tokens a request's outputs may hold for a consumer that does not
        # take them (see `output_buffer`); past it the request is aborted.
        self.max_stream_buffer_tokens = max_stream_buffer_tokens
        self._on_stream_overflow = on_stream_overflow
        self._commands: queue.SimpleQueue[_Admit | _Abort | _Call | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._error: BaseException | None = None
        self._stopping = False
        # Commands are posted and, once the loop died, refused under this lock, so none
        # is left unanswered.
        self._post_lock = threading.Lock()
        self._pending_admits = 0

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

    @property
    def num_queued(self) -> int:
        """Requests posted and not yet given their first step: the admission queue."""
        return self._pending_admits + len(self.engine.scheduler.waiting)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        hold_blocks: bool = False,
        label: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate (raising InvalidRequestError at once), queue, and yield outputs
        until the request finishes. Leaving the iteration early aborts it. `label` is
        the client's name for the request (logs, faults aimed at one request)."""
        self.engine.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        prompt = list(prompt_token_ids)

        def admit(engine: LLMEngine) -> list[RequestOutput]:
            engine.add_request(request_id, prompt, params, hold_blocks=hold_blocks, label=label)
            return []

        async for output in self.stream(request_id, admit):
            yield output

    async def stream(self, request_id: str, admit: Admit) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of a request that `admit` puts into the engine (on the engine
        thread), until it finishes: those of every choice for n > 1, each with its
        index, in the order the engine produced them. Leaving the iteration early
        aborts it; so does leaving more than `max_stream_buffer_tokens` untaken
        (StreamOverflowError)."""
        loop = asyncio.get_running_loop()

        def overflowed() -> None:
            self._post(_Abort(request_id))
            if self._on_stream_overflow is not None:
                self._on_stream_overflow()

        outputs = OutputBuffer(self.max_stream_buffer_tokens, overflowed)

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put, item)

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

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request by id, or only its choice `index` (no-op if it already
        ended); the choice's last output reaches the request's stream."""
        self._post(_Abort(request_id, index))

    def _post(self, command: _Admit | _Abort | _Call) -> None:
        """Queue a command for the engine thread, or answer it at once if the loop died."""
        with self._post_lock:
            if self._error is None:
                if isinstance(command, _Admit):
                    self._pending_admits += 1
                self._commands.put(command)
                self._wake.set()
                return
            error = self._error
        _refuse(command, error)

    # -- the engine thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                changed = self._drain_commands() + self.engine.expire_leases()
                changed += self._expire_queued()
                self.engine.publish_prefix_events()  # those of the commands (a reset)
                if changed and not self.engine.has_unfinished():
                    self._deliver(self.engine.snapshot())  # e.g. an abort freed blocks
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=self._idle_wait())
                    self._wake.clear()
                    continue
                budget = self.engine.config.scheduler.max_num_batched_tokens
                faults.blocking_point("engine.step", self._batch_size(), budget=budget)
                stepped = self.engine.step()
                # The step's prefix-cache events in one wake-up, before its outputs: a
                # router hears of the blocks before the client of the answer.
                self.engine.publish_prefix_events()
                self._deliver(stepped)
        except BaseException as error:  # the loop must report, not vanish
            log.exception("engine step loop failed")
            self._die(error)

    def _batch_size(self) -> int:
        """The requests the next step carries: those running, and those waiting that
        fit beside them."""
        scheduler = self.engine.scheduler
        waiting = len(scheduler.waiting)
        return min(len(scheduler.running) + waiting, scheduler.config.max_num_seqs)

    def _die(self, error: BaseException) -> None:
        """Answer every request and every queued command with the engine's death."""
        with self._post_lock:
            self._error = error
        for sink in self._sinks.values():
            sink(EngineDeadError(f"the engine stopped: {error}"))
        self._sinks.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                _refuse(command, error)

    def _expire_queued(self) -> int:
        """Fail requests that waited past the queue's deadline; how many did."""
        if self.queue_timeout_s is None:
            return 0
        expired = self.engine.expire_queued(self.queue_timeout_s)
        for request_id in expired:
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(QueueTimeoutError(
                    f"the request waited more than {self.queue_timeout_s:g}s in the queue"
                ))  # fmt: skip
        return len(expired)

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
                with self._post_lock:
                    self._pending_admits -= 1
                self._admit(command)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                self._abort(command)

    def _admit(self, command: _Admit) -> None:
        try:
            first = command.admit(self.engine)
        except Exception as error:  # the request's own failure, unless the engine's
            if is_engine_fault(error, num_tokens=1):
                raise
            command.sink(error)
            return
        if not any(output.finished for output in first):
            self._sinks[command.request_id] = command.sink
        for output in first:
            command.sink(output)

    def _call(self, command: _Call) -> None:
        try:
            result = command.function(self.engine)
        except Exception as error:
            command.done(None, error)
            return
        command.done(result, None)

    def _abort(self, command: _Abort) -> None:
        output = self.engine.abort(command.request_id, command.index)
        sink = self._sinks.get(command.request_id)
        if command.index is None or (output is not None and output.finished):
            self._sinks.pop(command.request_id, None)
        if output is not None and sink is not None:
            sink(output)

    def _deliver(self, result: StepResult) -> None:
        for output in result.outputs:
            sink = self._sinks.get(output.request_id)
            if sink is not None:
                sink(output)
            if output.finished:
                self._sinks.pop(output.request_id, None)
        for failure in result.failed:
            sink = self._sinks.pop(failure.request_id, None)
            if sink is not None:
                sink(failure)
        for observer in self.observers:
            try:
                observer.on_step(result)
            except Exception:  # metrics must never stop serving
                log.exception("engine observer failed")


def _refuse(command: _Admit | _Abort | _Call, error: BaseException) -> None:
    """Answer a command the dead engine will never run."""
    dead = EngineDeadError(f"the engine stopped: {error}")
    if isinstance(command, _Admit):
        command.sink(dead)
    elif isinstance(command, _Call):
        command.done(None, dead)
