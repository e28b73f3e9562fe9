"""What chunked prefill buys: P99 and max ITL with and without chunking, on the same
mixed workload (long prompts arriving while short ones stream), in the same run, and
what it costs in TTFT. Run with `make bench`."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.workers.bench.config import BenchConfig
from pdserve.workers.bench.metrics import SLO, BenchMetrics, GroupMetrics
from pdserve.workers.bench.runner import run_benchmark
from pdserve.workers.engine.config import ModelConfig
from pdserve.workers.server.process import running_worker
from support.results import publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BUDGET = 256  # tokens per step with chunking
DURATION_S = 60.0
RATE = 1.0
# A third of the requests carry long prompts, so that a long prefill regularly lands
# while several short requests stream (at a 15% share, stalls stay under 1% of the
# gaps: they move the max, not the P99).
LONG_SHARE = 0.3


def serve_and_measure(model_dir: Path, log_dir: Path, *worker_args: str) -> BenchMetrics:
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    with running_worker(model_dir, log_dir / "worker.log", worker_args) as worker:
        config = BenchConfig(
            url=worker.url,
            workload="mixed",
            long_share=LONG_SHARE,
            rate=RATE,
            duration_s=DURATION_S,
            seed=11,
            vocab_size=vocab,
            slo=SLO(ttft_ms=3000.0, tpot_ms=250.0, itl_ms=None, e2e_ms=None),
        )
        return run_benchmark(config).metrics


def test_chunking_cuts_p99_itl(tiny_model_dir: Path, tmp_path: Path) -> None:
    budget = ("--max-num-batched-tokens", str(BUDGET))
    runs = {
        "chunked": serve_and_measure(tiny_model_dir, tmp_path / "chunked", *budget),
        "unchunked": serve_and_measure(
            tiny_model_dir, tmp_path / "whole", *budget, "--no-chunked-prefill"
        ),
    }
    rows = []
    for mode, metrics in runs.items():
        rows.append(_row(mode, "all", metrics.overall))
        for bucket in ("<=256", "<=4096"):  # the short chat prompts, the long ones
            if bucket in metrics.buckets:
                rows.append(_row(mode, bucket, metrics.buckets[bucket]))
    chunked, unchunked = runs["chunked"].overall, runs["unchunked"].overall
    assert chunked.itl and unchunked.itl and chunked.ttft and unchunked.ttft
    long_chunked, long_whole = (
        runs["chunked"].buckets["<=4096"],
        runs["unchunked"].buckets["<=4096"],
    )
    assert long_chunked.ttft and long_whole.ttft
    ratios = {
        "p99_itl_chunked_over_unchunked": chunked.itl.p99 / unchunked.itl.p99,
        "max_itl_chunked_over_unchunked": chunked.itl.max / unchunked.itl.max,
        "p50_ttft_chunked_over_unchunked": chunked.ttft.p50 / unchunked.ttft.p50,
        "p99_ttft_chunked_over_unchunked": chunked.ttft.p99 / unchunked.ttft.p99,
        "long_prompt_p50_ttft_chunked_over_unchunked": long_chunked.ttft.p50 / long_whole.ttft.p50,
    }
    publish(
        "chunked_prefill_itl",
        rows,
        {
            "ratios": ratios,
            "budget": BUDGET,
            "rate": RATE,
            "long_share": LONG_SHARE,
            "duration_s": DURATION_S,
        },
    )
    assert chunked.failed == 0 and unchunked.failed == 0
    assert ratios["p99_itl_chunked_over_unchunked"] < 0.8


def _row(mode: str, bucket: str, group: GroupMetrics) -> dict[str, object]:
    assert group.itl and group.ttft and group.tpot
    return {
        "mode": mode,
        "bucket": bucket,
        "requests": group.succeeded,
        "itl_p50_ms": group.itl.p50 * 1e3,
        "itl_p99_ms": group.itl.p99 * 1e3,
        "itl_max_ms": group.itl.max * 1e3,
        "ttft_p50_ms": group.ttft.p50 * 1e3,
        "ttft_p99_ms": group.ttft.p99 * 1e3,
        "tpot_p50_ms": group.tpot.p50 * 1e3,
        "goodput_rps": group.goodput,
    }
