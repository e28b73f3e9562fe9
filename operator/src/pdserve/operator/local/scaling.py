"""The SLO planner driving a local pool (`pdserve local` with autoscaling): the
operator's scaling round (scaling.py) every `intervalSeconds`, acted on by starting
and stopping worker processes, with the pool's status (conditions, replica counts,
the last decisions) written to a file after each round.

It runs in a thread of its own, beside the local pool's main loop, with an event loop
for its Prometheus queries; starting or stopping workers blocks that thread only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import aiohttp

from pdserve.operator import api, render
from pdserve.operator.controller.status import ScalingReport, with_scaling
from pdserve.operator.local.rounds import Rounds
from pdserve.operator.scaling import planner
from pdserve.operator.scaling.promql import PoolQueries
from pdserve.operator.scaling.round import Outcome, change_text, decide, planner_scales, read_pool

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"
URL_FIX = "start pdserve local with --prometheus, or set spec.autoscaling.policy.prometheusUrl"


class Fleet(Protocol):
    """The worker processes of a local pool."""

    def replicas(self) -> dict[api.Role, planner.Replicas]:
        """Each role's workers: wanted, and ready."""

    def scale(self, role: api.Role, count: int) -> None:
        """Start or stop workers until `count` run (blocks until done)."""


def write_status(path: Path, status: api.ServingPoolStatus) -> None:
    """The status as JSON (as `kubectl get sp -o json` shows it), replaced whole."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(api.dump(status), indent=2) + "\n")
    partial.replace(path)


def read_status(path: Path) -> api.ServingPoolStatus:
    """A status file written by `write_status` (empty when there is none yet)."""
    try:
        return api.ServingPoolStatus.model_validate(json.loads(path.read_text()), by_name=False)
    except (OSError, ValueError):
        return api.ServingPoolStatus()


class LocalScaler:
    """Rounds of the planner over a local pool's workers (see the module's doc)."""

    def __init__(
        self,
        pool: api.ServingPool,
        fleet: Fleet,
        prometheus_url: str | None,
        status_file: Path,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pool = pool
        self.fleet = fleet
        self.prometheus_url = pool.spec.autoscaling.policy.prometheus_url or prometheus_url
        self.status_file = status_file
        self.status = api.ServingPoolStatus()
        self._clock = clock
        self._status_lock = threading.Lock()  # the rollouts' thread writes it too
        self._memory = planner.Memory()
        self._rounds = Rounds("local autoscaler", self._next_round, self._interval_s)

    def start(self) -> None:
        """Start the rounds in a thread of their own."""
        self._rounds.start()

    def stop(self) -> None:
        """Stop after the round under way (a worker starting or draining finishes)."""
        self._rounds.stop()

    def _interval_s(self) -> float:
        return float(self.pool.spec.autoscaling.policy.interval_seconds)

    async def _next_round(self, session: aiohttp.ClientSession) -> None:
        self._memory = await self.round(session, self._memory)

    async def round(self, session: aiohttp.ClientSession, memory: planner.Memory) -> planner.Memory:
        """Read, decide, write the status, start or stop workers, write the status
        again; the new memory. The status is written before acting, since starting a
        worker takes a while: the conditions show what this round saw meanwhile."""
        spec = self.pool.spec
        queries = PoolQueries(self.pool.metadata.name, None, spec.autoscaling.policy.window_seconds)
        reading = await read_pool(session, self.prometheus_url, queries, spec, URL_FIX)
        outcome = None
        if reading.signals is not None and planner_scales(spec):
            outcome = decide(
                spec, reading.signals, self.fleet.replicas(), self.status.autoscaling, memory,
                self._clock(),
            )  # fmt: skip
            memory = outcome.memory
        with self._status_lock:
            autoscaling = outcome.autoscaling if outcome is not None else self.status.autoscaling
            report = ScalingReport(reading.conditions, autoscaling)
            self.status = with_scaling(self.status, report)
        self._write()
        if outcome is not None:
            await self._act(outcome)
        return memory

    async def _act(self, outcome: Outcome) -> None:
        """Start or stop workers as the decisions say, one role after the other."""
        for role, count in outcome.changes.items():
            text = change_text(outcome.decisions[role])
            log.info("pool %s: %s", self.pool.metadata.name, text)
            print(f"pool {self.pool.metadata.name}: {text}", flush=True)
            await asyncio.to_thread(self.fleet.scale, role, count)
            self._write()

    def record_rollout(self, rollout: api.RolloutStatus) -> None:
        """A rollout's progress, into the status file."""
        with self._status_lock:
            self.status = self.status.model_copy(update={"rollout": rollout})
        self._write()

    def _write(self) -> None:
        """The status file, with the replicas as they are now."""
        with self._status_lock:
            self._record_replicas()
            write_status(self.status_file, self.status)

    def _record_replicas(self) -> None:
        counts: Mapping[api.Role, planner.Replicas] = self.fleet.replicas()
        update: dict[str, api.RoleStatus] = {}
        for role in render.ROLES:
            if role in counts:
                wanted, ready = counts[role].current, counts[role].ready
                update[role] = api.RoleStatus(desired_replicas=wanted, ready_replicas=ready)
        self.status = self.status.model_copy(update=update)
