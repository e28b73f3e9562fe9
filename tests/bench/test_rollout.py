"""Guarded rollouts under steady load, measured: the time from a bad budget's edit to
its rollback complete (the canary's workers gone) and the requests the canary served
before, the time a harmless change takes to complete, and the goodput (requests per
second meeting the pool's SLOs, as the router counts them) during each rollout against
the same load on the same pool with no rollout, in one run.

The bad budget is bad by construction (every step of a worker with the raised budget
stalls, as in tests/integration/test_local_rollout.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.operator.local.pool import LocalPool, role_revision
from support.prom import total
from support.results import publish
from support.rollouts import (
    QUIET,
    SHORT,
    SLOW_WHEN_BUDGET_RAISED,
    decode_rollout,
    rolling_pool,
    rollout_pool,
    write_manifest,
)
from support.scaling import Load
from support.waiting import wait_until

pytestmark = pytest.mark.slow

CLIENTS = 4
BASELINE_S = 40.0


def served(local: LocalPool) -> tuple[float, float]:
    """The router's count of requests that ended ok, and of those meeting the SLOs."""
    url = f"{local.url}/metrics"
    ok = total(url, "pdserve_router_requests_total", outcome="ok")
    return ok, total(url, "pdserve_router_slo_met_total")


def measured(local: LocalPool, until: Callable[[], object], timeout: float) -> dict[str, float]:
    """Seconds until `until()` holds, and the goodput and throughput meanwhile."""
    ok, met = served(local)
    started = time.monotonic()
    wait_until(until, timeout, "the phase's end", interval=0.2)
    seconds = time.monotonic() - started
    ok_after, met_after = served(local)
    return {
        "seconds": seconds,
        "requests_ok_per_s": (ok_after - ok) / seconds,
        "goodput_per_s": (met_after - met) / seconds,
    }


def test_rollout_times_and_goodput(small_model_dir: Path, tmp_path: Path) -> None:
    bad_rollout = {
        "type": "canary", "steps": [{"weight": 50, "analysisSeconds": 120}],
        "minRequests": 3, "conditions": QUIET,
    }  # fmt: skip
    good_rollout = {
        "type": "canary",
        "steps": [{"weight": 30, "analysisSeconds": 5}, {"weight": 60, "analysisSeconds": 5}],
        "minRequests": 3, "conditions": QUIET,
    }  # fmt: skip
    pool = rollout_pool("bench", small_model_dir, bad_rollout)
    bad = rollout_pool("bench", small_model_dir, bad_rollout, maxNumBatchedTokens=256)
    harmless = rollout_pool("bench", small_model_dir, good_rollout, maxNumSeqs=12)
    rows: list[dict[str, Any]] = []
    with (
        rolling_pool(pool, tmp_path, SLOW_WHEN_BUDGET_RAISED) as (local, _, manifest),
        Load(local.url, CLIENTS, SHORT, 4, vary=True) as load,
    ):
        wait_until(lambda: load.outcomes.ok >= 8, 120, "the pool serving")
        finish = time.monotonic() + BASELINE_S
        quiet = measured(local, lambda: time.monotonic() > finish, 120)
        rows.append({"phase": "no rollout", **quiet, "canary_requests": None})
        canary = role_revision(bad, "decode")
        write_manifest(manifest, bad)
        phase = measured(
            local,
            lambda: _ended(local, "RolledBack") and not local.of_revision("decode", canary),
            300,
        )
        url = f"{local.url}/metrics"
        by_canary = total(url, "pdserve_router_requests_total", decode_revision=canary)
        rows.append({"phase": "bad budget, rolled back", **phase, "canary_requests": by_canary})
        new, old = role_revision(harmless, "decode"), role_revision(pool, "decode")
        write_manifest(manifest, harmless)
        phase = measured(
            local,
            lambda: _ended(local, "Completed") and local.stable["decode"] == new
            and not local.of_revision("decode", old),
            300,
        )  # fmt: skip
        rows.append({"phase": "harmless, completed", **phase, "canary_requests": None})
    baseline = rows[0]["goodput_per_s"]
    for row in rows:
        row["goodput_vs_no_rollout"] = row["goodput_per_s"] / baseline if baseline else None
    publish(
        "rollout", rows,
        {"clients": CLIENTS, "failed_requests": len(load.outcomes.failed),
         "load_average": os.getloadavg()},
    )  # fmt: skip
    assert load.outcomes.failed == []


def _ended(local: LocalPool, phase: str) -> bool:
    rollout = decode_rollout(local)
    return rollout is not None and rollout.phase == phase
