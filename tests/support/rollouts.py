"""A local pool whose manifest a test edits while it runs, watched by the rollouts'
loop on a real Prometheus, and the pool's rollout as its status file says."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from pdserve.operator import api
from pdserve.operator.local.main import Monitoring, watched
from pdserve.operator.local.pool import LocalPool
from pdserve.operator.local.rollout import LocalRollouts, rolling_out
from pdserve.workers.faults import Fault, environment
from support.prometheus import SCRAPE_INTERVAL_S
from support.router import pool_manifest
from support.scaling import status
from support.tools import prometheus as prometheus_binary

ITL_TARGET_S = 1.5
# A decode step of a worker whose budget is over the stable one's stalls this long:
# every gap between its tokens is over the ITL target, whatever the machine's speed.
SLOW_STEP_S = 2.5
STABLE_BUDGET = 64

SHORT = [5, 6, 7, 8, 9, 10, 11, 12]
SLOW_WHEN_BUDGET_RAISED = {
    "decode": environment({"engine.step": Fault(delay_s=SLOW_STEP_S, budget_over=STABLE_BUDGET)})
}
# Only the ITL target and the error rates judge these canaries: the other conditions
# compare tail latencies of a few requests, which a busy machine can double.
QUIET = {
    "preemptionsWithTtft": {"enabled": False},
    "shortRequestsSlowed": {"enabled": False},
    "utilisationUpGoodputDown": {"enabled": False},
    "itlOverTarget": {"durationSeconds": 30},
}


def rollout_pool(
    name: str, model_dir: Path, rollout: dict[str, Any], **engine: int
) -> api.ServingPool:
    """A colocated pool of one decode worker whose changes roll out by `rollout`."""
    settings = {"maxNumBatchedTokens": STABLE_BUDGET, "maxNumSeqs": 16, "numKvBlocks": 256}
    decode = {
        "replicas": 1,
        "engine": {**settings, **engine},
        "rollout": rollout,
        "drainSeconds": 60,
    }
    return pool_manifest(
        name, model_dir, prefill=None, decode=decode,
        routing={"policy": "load", "buckets": [{"mode": "colocated"}]},
        slo={"ttft": {"seconds": 30.0}, "itl": {"seconds": ITL_TARGET_S}},
    )  # fmt: skip


def write_manifest(path: Path, pool: api.ServingPool) -> None:
    """The pool's manifest, as a user keeps it (written whole, then renamed)."""
    partial = path.with_suffix(".partial")
    partial.write_text(yaml.safe_dump(api.dump(pool)))
    partial.replace(path)


@contextmanager
def rolling_pool(
    pool: api.ServingPool, run_dir: Path, env: dict[str, dict[str, str]] | None = None
) -> Iterator[tuple[LocalPool, LocalRollouts, Path]]:
    """The pool started as `pdserve local -f MANIFEST --prometheus` starts it, with
    its manifest in a file the test edits."""
    manifest = run_dir / "pool.yaml"
    write_manifest(manifest, pool)
    monitoring = Monitoring(prometheus=True, scrape_interval_s=SCRAPE_INTERVAL_S)
    with (
        LocalPool(pool, run_dir, env=env) as local,
        watched(local, monitoring, prometheus_binary()) as scaler,
        rolling_out(local, scaler, manifest, interval_s=0.5) as rollouts,
    ):
        yield local, rollouts, manifest


def decode_rollout(local: LocalPool) -> api.RoleRolloutStatus | None:
    """The decode role's rollout, as the status file says."""
    rollout = status(local).rollout
    return rollout.decode if rollout is not None else None


def decisions(rollouts: LocalRollouts, action: str, reason: str) -> float:
    """Decisions of `action` for `reason` the rollout metrics counted (decode role)."""
    labels = {"pool_namespace": "", "pool": rollouts.local.name, "role": "decode"}
    labels |= {"action": action, "reason": reason}
    value = rollouts.metrics.registry.get_sample_value("pdserve_rollout_decisions_total", labels)
    return value or 0.0
