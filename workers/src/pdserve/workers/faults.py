"""Fault injection: named points in the data path where a test makes a worker stall or
fail on purpose, so a race is reproduced by construction instead of by timing.

Off unless the environment variable PDSERVE_FAULTS holds a JSON object that maps a
point's name to what happens there, e.g.
`{"prefill.before_write": {"delay_s": 2.0}}` or `{"engine.step": {"error": "boom"}}`.
A fault with `when` set to a path acts only while that file exists, so a test decides
the moment it strikes; `delay_per_request_s` stalls longer the more requests a step
carries (`engine.step`), as an accelerator's step costs more with a larger batch, so
latency follows load by construction; a point may carry a list of faults, applied in order (e.g. a
stall on every step, and an error once a file appears). A fault with `request` set
acts only for the request a client sent with that `X-Request-Id` (at the points that
concern single requests: `engine.prepare`, `engine.forward`, `engine.sample`,
`server.detokenize`), so a test can make one request of a batch fail. A fault with
`hold_while` set stalls for as long as that file exists: the test decides when the
stall ends, whatever the machine's speed. A fault with `budget_over` set acts only in
an engine whose step token budget (`--max-num-batched-tokens`) is larger
(`engine.step`), so a change of the budget is what makes a worker slow, by
construction. Each point is named where it is called; `POINTS` lists them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV = "PDSERVE_FAULTS"
# Logged each time a point fires: a test can wait for it to know the race is on.
MESSAGE = "fault injected at %s: %s"
_HOLD_POLL_S = 0.01  # how often a held point looks whether it may go on

POINTS = frozenset(
    {
        # The prefill worker has computed the prompt and holds its blocks; the write
        # has not begun (a cancel or the deadline can still stop it).
        "prefill.before_write",
        # Inside a transfer agent's write, after its last check of the deadline and
        # of a cancel: what follows lands in the peer's blocks. A stall here is a
        # write that lands late, whatever the writer checked before.
        "kv_transfer.before_post",
        # The engine thread, before each step.
        "engine.step",
        # Building a step's batch, for each request in it.
        "engine.prepare",
        # The model's forward pass, for each request in the batch.
        "engine.forward",
        # Drawing a request's token from its logits.
        "engine.sample",
        # Turning a request's new tokens into text (the worker's server).
        "server.detokenize",
    }
)


class InjectedFault(RuntimeError):
    """Raised at a point configured with an `error`."""


@dataclass(frozen=True)
class Fault:
    """What happens at one point: a stall, then optionally an error."""

    delay_s: float = 0.0
    error: str | None = None
    when: str | None = None  # a path: the fault acts only while this file exists
    delay_per_request_s: float = 0.0  # more stall per request the point is told of
    request: str | None = None  # acts only for the request with this client id
    hold_while: str | None = None  # a path: stall for as long as this file exists
    budget_over: int | None = None  # acts only in an engine with a larger token budget

    def active(self, labels: Collection[str | None] = (), budget: int | None = None) -> bool:
        """Whether the fault acts now, for work carrying the requests `labels` (their
        clients' ids), in an engine whose step token budget is `budget`."""
        if self.request is not None and self.request not in labels:
            return False
        if self.budget_over is not None and (budget is None or budget <= self.budget_over):
            return False
        return self.when is None or os.path.exists(self.when)


@functools.cache
def configured() -> dict[str, tuple[Fault, ...]]:
    """The faults of this process, read once from the environment."""
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    faults = {
        name: tuple(Fault(**item) for item in (spec if isinstance(spec, list) else [spec]))
        for name, spec in json.loads(raw).items()
    }
    unknown = set(faults) - POINTS
    if unknown:
        raise ValueError(f"{ENV}: unknown fault points {sorted(unknown)}; known: {sorted(POINTS)}")
    return faults


async def point(name: str) -> None:
    """An injection point on the event loop."""
    for fault in configured().get(name, ()):
        if not fault.active():
            continue
        log.warning(MESSAGE, name, fault)
        if fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        while fault.hold_while is not None and os.path.exists(fault.hold_while):
            await asyncio.sleep(_HOLD_POLL_S)
        if fault.error is not None:
            raise InjectedFault(fault.error)


def blocking_point(
    name: str,
    requests: int = 0,
    labels: Collection[str | None] = (),
    budget: int | None = None,
) -> None:
    """An injection point on a thread of its own (or in synchronous code); `requests`
    is how many requests the work that follows carries (for `delay_per_request_s`),
    `labels` their clients' ids (for faults aimed at one request), `budget` the
    engine's step token budget (for `budget_over`)."""
    for fault in configured().get(name, ()):
        if not fault.active(labels, budget):
            continue
        log.warning(MESSAGE, name, fault)
        delay = fault.delay_s + fault.delay_per_request_s * requests
        if delay:
            time.sleep(delay)
        while fault.hold_while is not None and os.path.exists(fault.hold_while):
            time.sleep(_HOLD_POLL_S)
        if fault.error is not None:
            raise InjectedFault(fault.error)


def environment(faults: Mapping[str, Fault | list[Fault]]) -> dict[str, str]:
    """The environment that configures `faults` in a child process."""

    def plain(fault: Fault) -> dict[str, object]:
        return {key: value for key, value in vars(fault).items() if value}

    spec = {
        name: [plain(f) for f in value] if isinstance(value, list) else plain(value)
        for name, value in faults.items()
    }
    return {ENV: json.dumps(spec)}
