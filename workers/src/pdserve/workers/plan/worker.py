"""One simulated worker: the real engine on a simulated clock, driven as the async
engine's thread drives it. Commands that arrive while a step runs wait for its end;
between steps they are applied in arrival order, leases and queued requests past
their deadlines expire, and the next step runs if any request waits or runs. A
step's outputs reach the pool when the step ends, at the time its profile gives, and
so do the prefix-cache events the step produced (to the router's index, `feed`). On
a host shared with other workers a step's end moves as their steps start and end
(`hosts`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from pdserve.workers.engine.config import EngineConfig, ModelConfig
from pdserve.workers.engine.engine import LLMEngine, StepResult
from pdserve.workers.engine.isolation import RequestFailedError
from pdserve.workers.engine.runner import resolve_kv_dtype
from pdserve.workers.engine.stats import RequestOutput
from pdserve.workers.plan.costs import ServingOverhead, StepCost
from pdserve.workers.plan.events import EventQueue, SimClock, draw_seed
from pdserve.workers.plan.hosts import SharedHost
from pdserve.workers.plan.routing import KVFeed
from pdserve.workers.plan.runner import runner_factory
from pdserve.workers.server.load import LoadTracker

# Something the worker does to its engine between steps (admit, reserve, adopt,
# release), with the outputs it produced at once.
Command = Callable[[LLMEngine], list[RequestOutput]]


class SimWorker:
    """A worker of the simulated pool."""

    def __init__(
        self,
        url: str,
        role: str,
        config: EngineConfig,
        model: ModelConfig,
        cost: tuple[StepCost, ServingOverhead],
        events: EventQueue,
        queue_timeout_s: float | None,
        on_step: Callable[[SimWorker, StepResult, float], None],
        host: tuple[SharedHost, int] | None = None,
        draw: int = 0,
    ) -> None:
        self.url = url
        self.role = role
        self.clock = SimClock()
        # On a shared host (with the worker's torch threads) its steps take its pace.
        self.host = None if host is None else host[0]
        pace = None if host is None else host[0].pace(url, host[1], self._end_at)
        runner = runner_factory(self.clock, *cost, pace, seed=draw_seed(url, draw))
        self.engine = LLMEngine(config, model, runner, self.clock)
        self.load = LoadTracker(self.engine, role)
        self.events = events
        self.queue_timeout_s = queue_timeout_s
        self.on_step = on_step
        self.num_steps = 0
        self.feed: KVFeed | None = None  # its prefix cache in the router's index
        itemsize = resolve_kv_dtype(config, model).itemsize
        # Bytes of KV one block holds across all layers: what a hand-off sends per block.
        self.block_bytes = (
            2 * model.num_layers * model.num_kv_heads * model.head_dim * itemsize
        ) * self.engine.block_size
        self._commands: list[Command] = []
        self._stepping = False  # a step is under way; its end is an event
        self._step: StepResult | None = None  # the step under way
        self._end_token = 0  # of the step's end event in force (an end that moved)
        self._woken = False  # a pass of the loop is due

    def post(self, command: Command) -> None:
        """Hand the engine a command; it runs before the next step."""
        self._commands.append(command)
        if not self._stepping and not self._woken:
            self._woken = True
            self.events.at(self.events.now, self._loop)

    def published_load(self) -> dict[str, Any]:
        """The body of the worker's GET /load now."""
        return asdict(self.load.snapshot(len(self._commands)))

    def _loop(self, now: float) -> None:
        """One pass of the engine thread's loop, at `now`."""
        self._woken = False
        self.clock.now = max(self.clock.now, now)
        outputs: list[RequestOutput] = []
        for command in self._drain():
            outputs += command(self.engine)
        self._publish()
        self.engine.expire_leases()
        failed = [
            RequestFailedError(request_id, TimeoutError("waited too long in the queue"))
            for request_id in self._expire_queued()
        ]
        if outputs or failed:
            snapshot = self.engine.snapshot().stats
            self.on_step(self, StepResult(outputs, snapshot, failed=failed), self.clock.now)
        if not self.engine.has_unfinished():
            return
        result = self.engine.step()
        if not result.chunks:
            # Nothing could run (no blocks, no seat): only a command or a lease running
            # out changes that, and a real engine spins meanwhile. Wait for either.
            self._wake_at(self.engine.leases.next_deadline())
            return
        self.num_steps += 1
        self._stepping = True
        self._step = result
        self._end_at(self.clock.now)

    def _end_at(self, when: float) -> None:
        """The step under way ends at `when` (an earlier end event no longer holds)."""
        self._end_token += 1
        token = self._end_token
        self.events.at(when, lambda at: self._end_due(token, at))

    def _end_due(self, token: int, now: float) -> None:
        if token == self._end_token and self._step is not None:
            result, self._step = self._step, None
            self._step_ended(result, now)

    def _wake_at(self, when: float | None) -> None:
        """A pass of the loop just past `when` (a lease expires then), unless a command
        brought one earlier."""
        if when is not None:
            self.events.at(when + 1e-6, self._lease_due)

    def _lease_due(self, now: float) -> None:
        if not self._stepping and not self._woken:
            self._loop(now)

    def _expire_queued(self) -> list[str]:
        """The requests that waited past the queue's deadline (the worker's 503)."""
        if self.queue_timeout_s is None:
            return []
        return self.engine.expire_queued(self.queue_timeout_s)

    def _drain(self) -> list[Command]:
        commands, self._commands = self._commands, []
        return commands

    def _publish(self) -> None:
        if self.feed is not None:
            self.feed.sync()

    def _step_ended(self, result: StepResult, now: float) -> None:
        self._stepping = False
        self.clock.now = now  # where the step really ended, on a shared host
        if self.host is not None:
            self.host.ended(self.url, now)
        self._publish()
        self.load.on_step(result)
        self.on_step(self, result, now)
        self._loop(now)
