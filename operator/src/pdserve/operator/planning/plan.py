"""A whole plan: read the pool, search, report, write the recommended pool."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from pdserve.operator import api
from pdserve.operator.local.pool import load_manifest
from pdserve.operator.planning.candidates import Bounds
from pdserve.operator.planning.recommend import recommended, recommended_pool, table, verdict
from pdserve.operator.planning.search import SearchSpace, Trial, search, targets_of
from pdserve.operator.planning.simulator import PLACEMENTS, PlanError, Simulator

# Input-length buckets the figures are broken down by, beside the pool's own bounds.
REPORT_BUCKETS = (256, 1024, 4096)


def run_plan(
    file: Path,
    profile: Path,
    traffic: Sequence[str],
    output: Path,
    max_workers: int | None,
    json_path: Path | None,
    progress: Callable[[Trial], None],
    placement: str = PLACEMENTS[0],
) -> int:
    """Plan the pool in `file` with its workers placed as `placement` says; 0 with a
    recommendation written, 1 without one."""
    pool = load_manifest(file)
    targets = targets_of(pool.spec.slo)
    if not targets:
        raise PlanError(f"{file}: spec.slo names no target (ttft or itl) to plan for")
    space = SearchSpace(
        pool.metadata.name, pool.spec, Bounds.of(pool.spec, max_workers), tuple(targets),
        _report_buckets(pool.spec), placement,
    )  # fmt: skip
    started = time.perf_counter()
    with Simulator(profile, traffic) as simulator:
        trials = search(space, simulator, progress)
    elapsed = time.perf_counter() - started
    print(table(trials))
    print()
    print(verdict(trials))
    # Each trial simulated its traffic once a draw.
    simulated = sum(t.result["simulated_s"] * t.result.get("draws", 1) for t in trials)
    busy = sum(t.result["wall_s"] for t in trials)
    speed = simulated / max(busy, 1e-9)
    print(f"{len(trials)} pools simulated in {elapsed:.1f}s "
          f"({simulated:.0f}s of traffic, {speed:.0f}x real time)")  # fmt: skip
    if json_path is not None:
        json_path.write_text(json.dumps([_trial_json(t) for t in trials], indent=2) + "\n")
    best = recommended(trials)
    if best is None:
        return 1
    manifest = yaml.safe_load(file.read_text())
    provenance = f"profile {profile.name}; traffic {' '.join(traffic)}; {best.candidate.name}"
    planned = recommended_pool(manifest, trials, best, provenance)
    output.write_text(yaml.safe_dump(planned, sort_keys=False))
    print(f"wrote {output}")
    return 0


def _report_buckets(spec: api.ServingPoolSpec) -> tuple[int, ...]:
    own = {b.max_input_tokens for b in spec.routing.buckets if b.max_input_tokens is not None}
    return tuple(sorted(own | set(REPORT_BUCKETS)))


def _trial_json(trial: Trial) -> dict[str, object]:
    return {"pool": trial.candidate.name, "meets": trial.meets, **trial.result}
