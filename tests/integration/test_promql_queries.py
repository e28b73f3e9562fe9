"""The autoscaler's PromQL (promql.py), evaluated by Prometheus' own engine over
synthetic series (`promtool test rules`): each query reads only its pool, prefers
the router's histograms and falls back to the workers', and gives the numbers the
planner and the DisaggregationActive condition expect.

Series grow per minute; queries look back 5 minutes and are evaluated at minute 10.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.operator.scaling.promql import ITL, TTFT, PoolQueries
from support.tools import promtool

QUERIES = PoolQueries("chat", "llm", window_seconds=300)
MINE = {"pool": "chat", "namespace": "llm"}
OTHER_NAMESPACE = {"pool": "chat", "namespace": "other"}
OTHER_POOL = {"pool": "rag", "namespace": "llm"}


def series(name: str, per_minute: float, labels: dict[str, str], **more: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in {**labels, **more}.items())
    return {"series": f"{name}{{{text}}}", "values": f"0+{per_minute}x10"}


def gauge(name: str, value: float, labels: dict[str, str], **more: str) -> dict[str, str]:
    entry = series(name, 0, labels, **more)
    return {**entry, "values": f"{value}x10"}


def histogram(
    name: str, per_minute: Mapping[str, float], labels: dict[str, str], **more: str
) -> list[dict[str, str]]:
    out = [series(f"{name}_bucket", n, labels, le=le, **more) for le, n in per_minute.items()]
    out.append(series(f"{name}_count", per_minute["+Inf"], labels, **more))
    return out


# p95 = 0.95 s (half of the requests between 0.5 s and 1 s), p50 = 0.5 s.
SLOW = {"0.5": 50, "1.0": 100, "+Inf": 100}
# p95 = 0.095 s.
FAST = {"0.1": 100, "0.5": 100, "1.0": 100, "+Inf": 100}


def evaluate(
    tmp_path: Path, input_series: list[dict[str, str]], checks: list[dict[str, Any]]
) -> None:
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "promql_expr_test": [{"eval_time": "10m", **check} for check in checks],
            }
        ],
    }
    path = tmp_path / "queries.test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run(
        [str(promtool()), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def sample(value: float, **labels: str) -> dict[str, Any]:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"labels": "{" + text + "}", "value": value}


def test_ttft_per_mode_from_the_router_not_other_pools(tmp_path: Path) -> None:
    router = {**MINE, "role": "router"}
    input_series = [
        *histogram(TTFT, SLOW, router, mode="disaggregated", bucket="gt1024"),
        *histogram(TTFT, FAST, router, mode="colocated", bucket="le1024"),
        *histogram(TTFT, FAST, {**MINE, "role": "decode"}, mode="disaggregated", bucket="x"),
        *histogram(TTFT, FAST, {**OTHER_NAMESPACE, "role": "router"}, mode="colocated"),
        *histogram(TTFT, SLOW, {**OTHER_POOL, "role": "router"}, mode="colocated"),
    ]
    checks = [
        {
            "expr": QUERIES.ttft_quantile(0.95),
            "exp_samples": [sample(0.95, mode="disaggregated"), sample(0.095, mode="colocated")],
        },
        {"expr": QUERIES.requests(), "exp_samples": [sample(1000.0)]},  # 2 x 100/min x 5 min
    ]
    evaluate(tmp_path, input_series, checks)


def test_latencies_fall_back_to_the_workers_without_a_router(tmp_path: Path) -> None:
    input_series = [
        *histogram(TTFT, SLOW, {**MINE, "role": "both"}, mode="colocated"),
        *histogram(ITL, SLOW, {**MINE, "role": "both"}, mode="colocated"),
        *histogram(ITL, SLOW, {**MINE, "role": "prefill"}, mode="colocated"),  # not served from
        series("pdserve_requests_total", 60, {**MINE, "role": "both"}, finish_reason="stop"),
    ]
    checks = [
        {"expr": QUERIES.ttft_quantile(0.5), "exp_samples": [sample(0.5, mode="colocated")]},
        {"expr": QUERIES.itl_quantile(0.95), "exp_samples": [sample(0.95)]},
        {"expr": QUERIES.request_rate(), "exp_samples": [sample(1.0)]},
    ]
    evaluate(tmp_path, input_series, checks)


def test_itl_and_rate_from_the_router(tmp_path: Path) -> None:
    router = {**MINE, "role": "router"}
    input_series = [
        *histogram(ITL, FAST, router, mode="colocated"),
        *histogram(ITL, SLOW, {**MINE, "role": "decode"}, mode="colocated"),
        series("pdserve_router_requests_total", 120, router, mode="colocated", outcome="ok"),
        series("pdserve_router_requests_total", 60, router, mode="colocated", outcome="error"),
        series("pdserve_requests_total", 600, {**MINE, "role": "decode"}, finish_reason="stop"),
    ]
    checks = [
        {"expr": QUERIES.itl_quantile(0.95), "exp_samples": [sample(0.095)]},
        {"expr": QUERIES.request_rate(), "exp_samples": [sample(3.0)]},
    ]
    evaluate(tmp_path, input_series, checks)


def test_worker_loads_per_role(tmp_path: Path) -> None:
    def worker(
        role: str, instance: str, running: float, waiting: float, kv: float
    ) -> list[dict[str, str]]:
        labels = {**MINE, "role": role, "instance": instance}
        return [
            gauge("pdserve_requests_running", running, labels),
            gauge("pdserve_requests_waiting", waiting, labels),
            gauge("pdserve_kv_cache_usage_ratio", kv, labels),
        ]

    input_series = [
        *worker("prefill", "p0", 2, 6, 0.1),
        *worker("prefill", "p1", 4, 2, 0.3),
        *worker("decode", "d0", 10, 0, 0.5),
        gauge("pdserve_requests_running", 99, {**OTHER_POOL, "role": "decode"}),
    ]
    checks = [
        {
            "expr": QUERIES.workers(),
            "exp_samples": [sample(2, role="prefill"), sample(1, role="decode")],
        },
        {
            "expr": QUERIES.per_worker("pdserve_requests_waiting"),
            "exp_samples": [sample(4, role="prefill"), sample(0, role="decode")],
        },
        {
            "expr": QUERIES.per_worker("pdserve_kv_cache_usage_ratio"),
            "exp_samples": [sample(0.2, role="prefill"), sample(0.5, role="decode")],
        },
        {"expr": QUERIES.reporting(), "exp_samples": [sample(3)]},
    ]
    evaluate(tmp_path, input_series, checks)


def test_disaggregation_rates(tmp_path: Path) -> None:
    router = {**MINE, "role": "router"}
    decode = {**MINE, "role": "decode"}
    input_series = [
        series(
            "pdserve_router_decisions_total", 120, router, bucket="gt1024", mode="disaggregated"
        ),
        series("pdserve_router_decisions_total", 600, router, bucket="le1024", mode="colocated"),
        series("pdserve_router_requests_total", 60, router, mode="disaggregated", outcome="ok"),
        series("pdserve_router_requests_total", 60, router, mode="colocated", outcome="ok"),
        series("pdserve_router_fallbacks_total", 60, router, bucket="gt1024", reason="no_prefill"),
        series("pdserve_kv_transfer_duration_seconds_count", 60, decode),
        series("pdserve_kv_transfer_duration_seconds_count", 60, {**MINE, "role": "prefill"}),
        series("pdserve_kv_transfer_failures_total", 30, decode, reason="transfer_failed"),
        gauge("pdserve_router_workers", 2, router, target="prefill", state="available"),
        gauge("pdserve_router_workers", 1, router, target="prefill", state="unavailable"),
    ]
    checks = [
        {"expr": QUERIES.disaggregated_routed(), "exp_samples": [sample(2.0)]},
        {"expr": QUERIES.disaggregated_served(), "exp_samples": [sample(1.0)]},
        {"expr": QUERIES.fallbacks(), "exp_samples": [sample(1.0, reason="no_prefill")]},
        {"expr": QUERIES.transfers(), "exp_samples": [sample(1.0)]},
        {
            "expr": QUERIES.transfer_failures(),
            "exp_samples": [sample(0.5, reason="transfer_failed")],
        },
        {"expr": QUERIES.prefill_available(), "exp_samples": [sample(2)]},
    ]
    evaluate(tmp_path, input_series, checks)


@pytest.mark.parametrize(("prefill_workers", "expected"), [(2, [sample(2)]), (0, [])])
def test_prefill_available_without_a_router(
    tmp_path: Path, prefill_workers: int, expected: list[dict[str, Any]]
) -> None:
    input_series = [
        gauge("pdserve_requests_running", 1, {**MINE, "role": "prefill", "instance": f"p{i}"})
        for i in range(prefill_workers)
    ] + [gauge("pdserve_requests_running", 1, {**MINE, "role": "decode"})]
    evaluate(
        tmp_path, input_series, [{"expr": QUERIES.prefill_available(), "exp_samples": expected}]
    )


def test_a_pool_in_no_namespace_is_selected_by_name_alone() -> None:
    local = PoolQueries("chat", window_seconds=0.5)
    assert local.select('role="router"') == '{pool="chat",role="router"}'
    assert local.window == "[500ms]"
    quoted = PoolQueries('a"b', "n\\s")
    assert quoted.select() == '{pool="a\\"b",namespace="n\\\\s"}'
