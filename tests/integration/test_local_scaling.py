"""The planner scaling a local pool on a real Prometheus scraping its router and
workers. Latency follows load by construction: every engine step of the workers under
test stalls in proportion to the requests it carries (a fault injected into them), so
one worker fewer for the same clients means slower steps, however fast the machine.

- TTFT: long prompts (disaggregated) from four clients make the one prefill worker's
  steps slow enough to break the TTFT target; the planner adds a prefill worker and
  TTFT comes back under target; with one client left it takes the worker away again,
  and no request fails on the way.
- ITL: streams from eight clients on one decode worker break the ITL target; the
  planner adds a decode worker, ITL comes back under target, and scales down without a
  failed request when the load falls.
- DisaggregationActive turns False when the prefill worker is killed, and True again
  once the planner has started a new one (min 1)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from pdserve.operator import api
from pdserve.operator.local.scaling import LocalScaler, read_status
from pdserve.operator.scaling import planner
from support.prometheus import running_prometheus
from support.router import pool_manifest
from support.scaling import (
    LONG,
    TTFT_TARGET_S,
    Load,
    condition,
    percentile_now,
    scaled_pool,
    scaling_policy,
    stalled,
    status,
    timed_wait,
    ttft_p90,
    ttft_pool,
    workers,
)

SHORT = [5, 6, 7, 8]  # colocated


def itl_p90(scaler: LocalScaler) -> float | None:
    """ITL p90 over the planner's window."""
    return percentile_now(scaler, lambda q: q.itl_quantile(0.9))


def test_a_ttft_breach_adds_a_prefill_worker_and_low_load_takes_it_away(
    small_model_dir: Path, tmp_path: Path
) -> None:
    pool = ttft_pool("ttft", small_model_dir)
    with scaled_pool(pool, tmp_path, env={"prefill": stalled(0.5)}) as (local, scaler):
        with Load(local.url, 4, LONG, 2) as heavy:
            timed_wait(lambda: workers(local, "prefill") == 2, 300, "a second prefill worker")
            decided = status(local).autoscaling
            assert decided is not None and decided.prefill is not None
            assert decided.prefill.reason in ("TTFTAboveTarget", "PrefillQueueHigh")
            assert condition(local, "ScalingActive").status == "True"  # type: ignore[union-attr]
            timed_wait(
                lambda: (p := ttft_p90(scaler)) is not None and p < TTFT_TARGET_S, 300,
                "TTFT p90 back under its target",
            )  # fmt: skip
        assert workers(local, "prefill") == 2
        with Load(local.url, 1, LONG, 2) as light:
            timed_wait(lambda: workers(local, "prefill") == 1, 300, "the prefill pool back to 1")
        assert workers(local, "decode") == 1
    assert heavy.outcomes.failed == [] and light.outcomes.failed == []
    assert heavy.outcomes.ok > 0 and light.outcomes.ok > 0


def test_an_itl_breach_adds_a_decode_worker_and_low_load_takes_it_away(
    small_model_dir: Path, tmp_path: Path
) -> None:
    # Every decode step stalls 0.3 s per running stream: 8 streams make 2.4 s gaps
    # on one worker, 1.2 s on two; the target, 2 s at p90, lies between, on a bucket
    # bound of the histogram (1.5, 2, 3), so the work of a busy machine on top of the
    # stall moves neither percentile across it. Streams are short and the window long
    # enough that requests end in every window (latencies count when a request ends).
    pool = pool_manifest(
        "itl", small_model_dir, prefill=None, routing={"buckets": [{"mode": "colocated"}]},
        slo={"ttft": {"seconds": 30.0}, "itl": {"seconds": 2.0, "percentile": 90}},
        autoscaling={
            "enabled": True, "decode": {"minReplicas": 1, "maxReplicas": 2},
            "policy": scaling_policy(windowSeconds=20),
        },
    )  # fmt: skip
    with scaled_pool(pool, tmp_path, env={"decode": stalled(0.3)}) as (local, scaler):
        with Load(local.url, 8, SHORT, 4) as heavy:
            timed_wait(lambda: workers(local, "decode") == 2, 300, "a second decode worker")
            decided = status(local).autoscaling
            assert decided is not None and decided.decode is not None
            assert decided.decode.reason == "ITLAboveTarget"
            timed_wait(
                lambda: (p := itl_p90(scaler)) is not None and p < 2.0, 300,
                "ITL p90 back under its target",
            )  # fmt: skip
        with Load(local.url, 1, SHORT, 4) as light:
            timed_wait(lambda: workers(local, "decode") == 1, 300, "the decode pool back to 1")
    assert heavy.outcomes.failed == [] and light.outcomes.failed == []
    assert heavy.outcomes.ok > 0 and light.outcomes.ok > 0


def test_disaggregation_turns_false_when_the_prefill_worker_dies_and_true_when_back(
    small_model_dir: Path, tmp_path: Path
) -> None:
    pool = pool_manifest(
        "disagg", small_model_dir,
        autoscaling={
            "enabled": True, "prefill": {"minReplicas": 1, "maxReplicas": 1},
            "decode": {"minReplicas": 1, "maxReplicas": 1}, "policy": scaling_policy(),
        },
    )  # fmt: skip

    def disaggregation() -> str | None:
        found = condition(local, "DisaggregationActive")
        return None if found is None else found.status

    with scaled_pool(pool, tmp_path) as (local, _), Load(local.url, 1, LONG, 2):
        timed_wait(lambda: disaggregation() == "True", 120, "DisaggregationActive True")
        (prefill,) = local.workers["prefill"]
        prefill.process.kill()
        timed_wait(lambda: disaggregation() == "False", 120, "DisaggregationActive False")
        down = condition(local, "DisaggregationActive")
        assert down is not None
        assert down.reason in ("NoPrefillWorkerReady", "AllFallingBack", "TransfersFailing")
        timed_wait(lambda: disaggregation() == "True", 300, "DisaggregationActive True again")
        (restarted,) = local.workers["prefill"]
        assert restarted is not prefill and restarted.running()


class Recorded:
    """A fleet that records what it is told (the planner must tell it nothing)."""

    def __init__(self) -> None:
        self.scaled: list[tuple[str, int]] = []

    def replicas(self) -> dict[api.Role, planner.Replicas]:
        return {"prefill": planner.Replicas(1, 1), "decode": planner.Replicas(1, 1)}

    def scale(self, role: api.Role, count: int) -> None:
        self.scaled.append((role, count))


def one_round(scaler: LocalScaler) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await scaler.round(session, planner.Memory())

    asyncio.run(run())


def test_without_usable_metrics_the_local_planner_scales_nothing_and_says_why(
    small_model_dir: Path, tmp_path: Path
) -> None:
    pool = pool_manifest(
        "blind", small_model_dir,
        autoscaling={"enabled": True, "policy": scaling_policy()},
    )  # fmt: skip
    fleet = Recorded()
    with running_prometheus(tmp_path / "gone") as gone:
        gone_url = gone.url  # nothing answers there once the block ends
    with running_prometheus(tmp_path / "empty") as empty:  # scrapes nothing
        cases = {None: "NoPrometheusUrl", empty.url: "NoMetrics", gone_url: "PrometheusUnreachable"}
        for url, reason in cases.items():
            status_file = tmp_path / f"{reason}.json"
            one_round(LocalScaler(pool, fleet, url, status_file))
            found = {c.type: c for c in read_status(status_file).conditions}
            assert found["ScalingActive"].status == "False"
            assert found["ScalingActive"].reason == reason
            assert "not scaling" in found["ScalingActive"].message
            assert found["DisaggregationActive"].status == "Unknown"
    unset = {c.type: c for c in read_status(tmp_path / "NoPrometheusUrl.json").conditions}
    assert "--prometheus" in unset["ScalingActive"].message
    assert fleet.scaled == []
