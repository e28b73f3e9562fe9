"""Routing modes on a mixed workload: P99 ITL, P99 TTFT and goodput per input-length
bucket for all-colocated, all-disaggregated and bucketed routing, one after another in
one run on the same pool (the demo's: one prefill and one decode worker on the tiny
model); the routing table is switched by rewriting the router's routing file.

The workload is the Azure conversation trace, replayed slower and with prompts and
outputs scaled down for this machine, with a long prompt (2-3k tokens) in place of
every 8th request, so that long prompts cross the bucket boundary (512 tokens). Each
mode gets the same arrivals and lengths, with prompt contents of its own (no prefix
cache hits across modes). Run with `make bench`."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.cli.demo import BUCKET_BOUNDARY, demo_pool
from pdserve.operator import api
from pdserve.operator.local.pool import LocalPool
from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.metrics import SLO, GroupMetrics
from pdserve.workers.bench.runner import BenchResult, run_benchmark
from pdserve.workers.bench.trace import load_trace
from pdserve.workers.engine.config import ModelConfig
from support.results import publish
from support.router import local_pool, router_metric, worker_load
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_conv.csv"
START_S = 600.0  # past the trace's sparse first minutes
SECONDS = 120.0  # of arrivals per mode
TIME_SCALE = 5.0  # 24 s of the trace (110 requests) over 2 minutes
LENGTH_SCALE = 0.25
LONG_EVERY = 8
LONG_TOKENS = (2048, 3072)
MAX_OUTPUT_TOKENS = 128
SLO_TARGETS = SLO(ttft_ms=2000.0, tpot_ms=200.0)
MODES: dict[str, list[dict[str, Any]]] = {
    "all-colocated": [{"maxInputTokens": None, "mode": "colocated"}],
    "all-disaggregated": [{"maxInputTokens": None, "mode": "disaggregated"}],
    "bucketed": [
        {"maxInputTokens": BUCKET_BOUNDARY, "mode": "colocated"},
        {"maxInputTokens": None, "mode": "disaggregated"},
    ],
}


def mixed_trace(out: Path) -> Path:
    """The trace scaled to this machine, every LONG_EVERY-th prompt made long."""
    if not TRACE.is_file():
        pytest.skip(f"no trace at {TRACE}")
    rng = np.random.default_rng(7)
    start = datetime(2023, 11, 16, 18, 0, 0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows = [row for row in load_trace(TRACE) if row.offset_s >= START_S]
    for index, row in enumerate(rows):
        offset = (row.offset_s - START_S) * TIME_SCALE
        if offset >= SECONDS:
            break
        context = max(1, round(row.context_tokens * LENGTH_SCALE))
        if index % LONG_EVERY == LONG_EVERY - 1:
            context = int(rng.integers(*LONG_TOKENS))
        generated = max(1, round(row.generated_tokens * LENGTH_SCALE))
        lines.append(f"{start + timedelta(seconds=offset)},{context},{generated}")
    out.write_text("\n".join(lines) + "\n")
    return out


def use_buckets(local: LocalPool, buckets: list[dict[str, Any]]) -> None:
    """Switch the router's table and wait until it is in force."""

    def applied() -> float:
        return router_metric(local, "pdserve_router_config_reloads_total", result="applied")

    before = applied()
    table = json.loads(local.routing_file.read_text())
    if table["buckets"] == buckets:
        return
    table["buckets"] = buckets
    local.routing_file.write_text(json.dumps(table))
    wait_until(lambda: applied() > before, 30, "the routing table to switch")


def rows_of(mode: str, result: BenchResult) -> list[dict[str, Any]]:
    metrics = result.metrics
    groups: list[tuple[str, GroupMetrics]] = [("all", metrics.overall)]
    groups += [(label, group) for label, group in metrics.buckets.items() if group.requests]
    rows = []
    for label, group in groups:
        served = Counter(
            {
                f"{bucket} {m}": g.requests
                for bucket, modes in metrics.modes.items()
                if label in ("all", bucket)
                for m, g in modes.items()
            }
        )
        rows.append(
            {
                "routing": mode,
                "bucket": label,
                "requests": group.requests,
                "failed": group.failed,
                "ttft_p50_ms": _ms(group.ttft.p50 if group.ttft else None),
                "ttft_p99_ms": _ms(group.ttft.p99 if group.ttft else None),
                "itl_p50_ms": _ms(group.itl.p50 if group.itl else None),
                "itl_p99_ms": _ms(group.itl.p99 if group.itl else None),
                "goodput_req_s": group.goodput,
                "slo_attainment": group.slo_attainment,
                "served_disaggregated": sum(
                    n for key, n in served.items() if key.endswith(" disaggregated")
                ),
            }
        )
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def test_routing_modes_on_a_mixed_workload(tiny_model_dir: Path, tmp_path: Path) -> None:
    trace = mixed_trace(tmp_path / "mixed.csv")
    pool = api.parse_pool(demo_pool(tiny_model_dir))
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    rows: list[dict[str, Any]] = []
    with local_pool(pool, tmp_path / "pool") as local:
        workers = local.workers["prefill"] + local.workers["decode"]
        for seed, (mode, buckets) in enumerate(MODES.items()):
            use_buckets(local, buckets)
            config = BenchConfig(
                url=local.url, trace=trace, duration_s=SECONDS, seed=seed, slo=SLO_TARGETS,
                vocab_size=vocab,
                buckets=(BUCKET_BOUNDARY,), max_output_tokens=MAX_OUTPUT_TOKENS,
                drain_timeout_s=180.0,
            )  # fmt: skip
            result = run_benchmark(config)
            rows += rows_of(mode, result)
            wait_until(
                lambda: all(worker_load(w.url)["in_flight"] == 0 for w in workers),
                120, "the workers to drain",
            )  # fmt: skip
        fallbacks = router_metric(local, "pdserve_router_fallbacks_total")
    publish(
        "routing_modes", rows,
        {"trace": str(TRACE), "trace_from_s": START_S, "seconds_of_arrivals": SECONDS,
         "time_scale": TIME_SCALE,
         "length_scale": LENGTH_SCALE, "long_prompt_every": LONG_EVERY,
         "long_prompt_tokens": LONG_TOKENS, "slo": SLO_TARGETS.describe(),
         "bucket_boundary": BUCKET_BOUNDARY, "router_fallbacks": fallbacks},
    )  # fmt: skip
    assert all(row["failed"] == 0 for row in rows)
