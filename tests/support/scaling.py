"""A local pool scaled by the planner on a real Prometheus, a load that clients keep
up, and the pool's status as `pdserve local` writes it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.operator import api
from pdserve.operator.local.main import Monitoring, watched
from pdserve.operator.local.pool import LocalPool
from pdserve.operator.local.scaling import STATUS_FILE, LocalScaler, read_status
from pdserve.operator.scaling.promql import PoolQueries
from pdserve.workers.faults import Fault, environment
from support.background import Background
from support.prometheus import SCRAPE_INTERVAL_S, ask
from support.router import BOUNDARY, pool_manifest, stream
from support.tools import prometheus as prometheus_binary
from support.waiting import wait_until

LONG = list(range(5, 5 + 2 * BOUNDARY))  # a prompt of a disaggregated bucket
TTFT_TARGET_S = 2.5


def stalled(delay_per_request_s: float) -> dict[str, str]:
    """Engine steps stalled by this much per request they carry."""
    return environment({"engine.step": Fault(delay_per_request_s=delay_per_request_s)})


def ttft_pool(name: str, model_dir: Path) -> api.ServingPool:
    """A pool whose TTFT target one prefill worker breaks under 4 clients of LONG
    prompts, with `stalled(0.5)` prefill steps, and two keep: one prefill step holds
    every waiting prompt (1024 tokens), so 4 clients make 2 s steps on one worker, 1 s
    on two; the target, 2.5 s at p90, lies between."""
    engine = {"maxNumBatchedTokens": 1024, "maxNumSeqs": 16, "numKvBlocks": 256}
    return pool_manifest(
        name, model_dir,
        prefill={"replicas": 1, "engine": engine},
        slo={"ttft": {"seconds": TTFT_TARGET_S, "percentile": 90}},
        autoscaling={
            "enabled": True, "prefill": {"minReplicas": 1, "maxReplicas": 2},
            "decode": {"minReplicas": 1, "maxReplicas": 1}, "policy": scaling_policy(),
        },
    )  # fmt: skip


def scaling_policy(**policy: Any) -> dict[str, Any]:
    """spec.autoscaling.policy for tests: decisions every second over short windows."""
    base = {
        "intervalSeconds": 1, "windowSeconds": 4, "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 4, "cooldownSeconds": 2, "minRequests": 3,
        "maxScaleUpStep": 1,
    }  # fmt: skip
    return {**base, **policy}


@contextmanager
def scaled_pool(
    pool: api.ServingPool, run_dir: Path, env: dict[str, dict[str, str]] | None = None
) -> Iterator[tuple[LocalPool, LocalScaler]]:
    """The pool started as `pdserve local --prometheus` starts it, the planner's
    rounds running until the block ends."""
    binary = prometheus_binary()
    monitoring = Monitoring(prometheus=True, scrape_interval_s=SCRAPE_INTERVAL_S)
    with LocalPool(pool, run_dir, env=env) as local, watched(local, monitoring, binary) as scaler:
        yield local, scaler


def ttft_p90(scaler: LocalScaler) -> float | None:
    """TTFT p90 of the disaggregated requests over the planner's window."""
    return percentile_now(scaler, lambda q: q.ttft_quantile(0.9, "disaggregated"))


def percentile_now(scaler: LocalScaler, query: Callable[[PoolQueries], str]) -> float | None:
    """A latency percentile of the pool over the planner's window, as the planner
    reads it: `query` picks it from the pool's queries."""
    assert scaler.prometheus_url is not None
    spec = scaler.pool.spec
    queries = PoolQueries(scaler.pool.metadata.name, None, spec.autoscaling.policy.window_seconds)
    return ask(scaler.prometheus_url, lambda prometheus: prometheus.value(query(queries)))


def status(local: LocalPool) -> api.ServingPoolStatus:
    """The pool's status as last written."""
    return read_status(local.run_dir / STATUS_FILE)


def condition(local: LocalPool, kind: str) -> api.Condition | None:
    """One condition of the pool's status."""
    return next((c for c in status(local).conditions if c.type == kind), None)


def workers(local: LocalPool, role: api.Role) -> int:
    """The role's live workers."""
    return local.replicas()[role].current


@dataclass
class Outcomes:
    """What the clients of a load got."""

    ok: int = 0
    failed: list[str] = field(default_factory=list)


class Load(Background):
    """`clients` clients, each sending one streamed request after the other, until
    stopped; every answer counted. Runs in a thread of its own. With `vary`, each
    request's prompt starts with a token of its own (conversations of their own: a
    rollout's split sends them to either revision)."""

    def __init__(
        self, url: str, clients: int, prompt: list[int], tokens: int, vary: bool = False
    ) -> None:
        self.url, self.prompt, self.tokens = url, prompt, tokens
        self.clients = clients
        self.vary = vary
        self.sent = 0
        self.outcomes = Outcomes()
        super().__init__("load")

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session) for _ in range(self.clients)))

    def _prompt(self) -> list[int]:
        self.sent += 1
        if not self.vary:
            return self.prompt
        return [5 + self.sent % 1000, *self.prompt[1:]]

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self.stopping.is_set():
            try:
                code, ids, error = await stream(session, self.url, self._prompt(), self.tokens)
            except (aiohttp.ClientError, TimeoutError) as broken:
                self.outcomes.failed.append(repr(broken))
                continue
            if code == 200 and error is None and len(ids) == self.tokens:
                self.outcomes.ok += 1
            else:
                self.outcomes.failed.append(f"{code}: {error} ({len(ids)} tokens)")


def timed_wait(check: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until `check()` holds; fails after `timeout`."""
    started = time.monotonic()
    wait_until(check, timeout, what, interval=0.2)
    return time.monotonic() - started
