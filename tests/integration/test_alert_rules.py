"""The alert rules (deploy/monitoring/alerts.rules.yaml, rendered from the chart) and
the Grafana dashboard, checked with Debian's promtool: every query parses, and each
alert fires on a synthetic series that breaks its condition and stays silent on one
that comes close without breaking it (`promtool test rules`).

Latency alerts read the router's series (what clients saw): each of them also has a
silent case with the very series that fire it, reported by a worker instead.

Every case runs 140 minutes: the first 100 are the baseline, the last 40 the change
(a rollout of new latency settings); alerts are evaluated at minute 135, when the
baseline hour (offset 1h) still lies before the change.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.workers.metric_labels import LATENCY_BUCKETS
from render_deploy import CHART, DEPLOY
from support.promql import as_rules_file, dashboard_queries, rule_queries
from support.tools import promtool

RULES = DEPLOY / "monitoring" / "alerts.rules.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
BEFORE, AFTER = 100, 40  # minutes of baseline, then of change
EVAL_TIME = "135m"
POOL = {"namespace": "llm", "pool": "chat"}


def counter(per_minute: float, after: float | None = None, *, absent_before: bool = False) -> str:
    """promtool values of a counter growing by `per_minute`, then by `after` from
    minute BEFORE on (absent until then if `absent_before`)."""
    after = per_minute if after is None else after
    if absent_before:
        return f"_x{BEFORE - 1} 0+{after}x{AFTER + 1}"
    return f"0+{per_minute}x{BEFORE} {BEFORE * per_minute + after}+{after}x{AFTER - 1}"


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in {**POOL, **labels}.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def histogram(
    name: str, before: Mapping[str, float], after: Mapping[str, float], **labels: str
) -> list[dict[str, str]]:
    """Bucket counters (cumulative per-minute counts by `le`) before and after."""
    return [
        series(f"{name}_bucket", counter(before[le], after[le]), le=le, **labels) for le in before
    ]


@dataclass
class Case:
    alert: str
    fires: bool
    series: list[dict[str, str]] = field(default_factory=list)


ITL = "pdserve_inter_token_latency_seconds"
TTFT = "pdserve_time_to_first_token_seconds"
# P95 TTFT 0.475 s before; 0.95 s after (half the requests slower than 0.5 s).
TTFT_STEADY = {"0.5": 100, "1.0": 100, "+Inf": 100}
TTFT_SLOWER = {"0.5": 50, "1.0": 100, "+Inf": 100}
# Short prompts: P95 TTFT 0.095 s before, 0.35 s after.
SHORT_STEADY = {"0.1": 100, "0.2": 100, "0.5": 100, "+Inf": 100}
SHORT_SLOWER = {"0.1": 50, "0.2": 90, "0.5": 100, "+Inf": 100}
DECODE = {"role": "decode"}
ROUTER = {"role": "router"}

CASES = {
    "itl-p99-over-target": Case("PdserveITLP99AboveTarget", True, histogram(
        ITL, {"0.05": 100, "0.1": 100, "+Inf": 100}, {"0.05": 95, "0.1": 100, "+Inf": 100},
        **ROUTER,
    )),
    "itl-p99-just-under-target": Case("PdserveITLP99AboveTarget", False, histogram(
        ITL, {"0.05": 100, "0.1": 100, "+Inf": 100}, {"0.05": 995, "0.1": 1000, "+Inf": 1000},
        **ROUTER,
    )),
    "preemptions-and-ttft-rise": Case("PdservePreemptionsRisingWithTTFT", True, [
        series("pdserve_preemptions_total", counter(1, 30), **DECODE),
        *histogram(TTFT, TTFT_STEADY, TTFT_SLOWER, **ROUTER),
    ]),
    "preemptions-rise-ttft-holds": Case("PdservePreemptionsRisingWithTTFT", False, [
        series("pdserve_preemptions_total", counter(1, 30), **DECODE),
        *histogram(TTFT, TTFT_STEADY, TTFT_STEADY, **ROUTER),
    ]),
    "short-ttft-doubles-under-long-prompts": Case("PdserveShortRequestsTTFTDoubled", True, [
        *histogram(TTFT, SHORT_STEADY, SHORT_SLOWER, bucket="le256", **ROUTER),
        series(f"{TTFT}_count", counter(0, 5), bucket="gt4096", **ROUTER),
    ]),
    "short-ttft-doubles-without-long-prompts": Case("PdserveShortRequestsTTFTDoubled", False, [
        *histogram(TTFT, SHORT_STEADY, SHORT_SLOWER, bucket="le256", **ROUTER),
        series(f"{TTFT}_count", counter(0, 0), bucket="gt4096", **ROUTER),
    ]),
    "busy-engines-serve-fewer-in-time": Case("PdserveEngineBusyGoodputFalling", True, [
        series("pdserve_engine_step_duration_seconds_sum", counter(30, 57), **DECODE),
        series(f"{TTFT}_bucket", counter(100, 50), le="2.0", **ROUTER),
    ]),
    "busy-engines-keep-goodput": Case("PdserveEngineBusyGoodputFalling", False, [
        series("pdserve_engine_step_duration_seconds_sum", counter(30, 57), **DECODE),
        series(f"{TTFT}_bucket", counter(100, 100), le="2.0", **ROUTER),
    ]),
    "rejections-appear": Case("PdserveRequestErrorsAboveBaseline", True, [
        series("pdserve_requests_total", counter(100), finish_reason="stop"),
        series("pdserve_requests_rejected_total", counter(0, 10, absent_before=True)),
    ]),
    "rejections-at-their-baseline": Case("PdserveRequestErrorsAboveBaseline", False, [
        series("pdserve_requests_total", counter(100), finish_reason="stop"),
        series("pdserve_requests_rejected_total", counter(5)),
    ]),
    "cancels-appear": Case("PdserveRequestCancelsAboveBaseline", True, [
        series("pdserve_requests_total", counter(100), finish_reason="stop"),
        series("pdserve_requests_total", counter(0, 20, absent_before=True), finish_reason="abort"),
    ]),
    "cancels-at-their-baseline": Case("PdserveRequestCancelsAboveBaseline", False, [
        series("pdserve_requests_total", counter(100), finish_reason="stop"),
        series("pdserve_requests_total", counter(10), finish_reason="abort"),
    ]),
    "hand-offs-fail": Case("PdserveKVTransfersFailing", True, [
        series("pdserve_kv_wait_seconds_count", counter(100), **DECODE),
        series("pdserve_kv_transfer_failures_total", counter(0, 10, absent_before=True),
               reason="transfer_failed", **DECODE),
    ]),
    "few-hand-offs-fail": Case("PdserveKVTransfersFailing", False, [
        series("pdserve_kv_wait_seconds_count", counter(100), **DECODE),
        series("pdserve_kv_transfer_failures_total", counter(2), reason="transfer_failed",
               **DECODE),
    ]),
    "every-hand-off-falls-back": Case("PdserveDisaggregatedRequestsAllFallingBack", True, [
        series("pdserve_kv_wait_seconds_count", counter(100, 0), **DECODE),
        series("pdserve_kv_transfer_failures_total", counter(0, 10, absent_before=True),
               reason="no_blocks", **DECODE),
    ]),
    "some-hand-offs-fall-back": Case("PdserveDisaggregatedRequestsAllFallingBack", False, [
        series("pdserve_kv_wait_seconds_count", counter(100), **DECODE),
        series("pdserve_kv_transfer_failures_total", counter(0, 10, absent_before=True),
               reason="no_blocks", **DECODE),
    ]),
    # No prefill worker is healthy: the router serves colocated and no hand-off is
    # even tried, so the decode workers count no failure.
    "router-falls-back-with-no-hand-off": Case("PdserveDisaggregatedRequestsAllFallingBack", True, [
        series("pdserve_kv_wait_seconds_count", counter(100, 0), **DECODE),
        series("pdserve_router_fallbacks_total", counter(0, 10, absent_before=True),
               bucket="gt4096", reason="no_prefill", **ROUTER),
    ]),
    "router-falls-back-while-hand-offs-succeed": Case(
        "PdserveDisaggregatedRequestsAllFallingBack", False, [
            series("pdserve_kv_wait_seconds_count", counter(100), **DECODE),
            series("pdserve_router_fallbacks_total", counter(0, 10, absent_before=True),
                   bucket="gt4096", reason="no_prefill", **ROUTER),
        ]
    ),
}  # fmt: skip


def reported_by_a_worker(case: Case) -> Case:
    """A firing case's series as a decode worker reports them: silent, since a
    worker's latency is not what the client saw."""
    moved = [
        {**s, "series": s["series"].replace('role="router"', 'role="decode"')} for s in case.series
    ]
    return replace(case, fires=False, series=moved)


LATENCY_ALERTS = (
    "itl-p99-over-target", "preemptions-and-ttft-rise", "short-ttft-doubles-under-long-prompts",
    "busy-engines-serve-fewer-in-time",
)  # fmt: skip
CASES |= {f"{name}-on-workers-only": reported_by_a_worker(CASES[name]) for name in LATENCY_ALERTS}


def rules() -> dict[str, dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for group in loaded["groups"] for r in group["rules"] if "alert" in r}


def expected_alerts(rule: dict[str, Any]) -> list[dict[str, Any]]:
    """The one alert a breaking case raises: the pool's labels and the annotations
    with them filled in."""
    annotations = {}
    for key, text in rule["annotations"].items():
        for label, value in POOL.items():
            text = text.replace(f"{{{{ $labels.{label} }}}}", value)
        assert "{{" not in text, f"{rule['alert']}: annotation {key} has templates left"
        annotations[key] = text
    labels = {**rule["labels"], **POOL}
    return [{"exp_labels": labels, "exp_annotations": annotations}]


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool()), *args], capture_output=True, text=True, check=False)


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    covered = {(case.alert, case.fires) for case in CASES.values()}
    assert covered == {(alert, fires) for alert in rules() for fires in (True, False)}


@pytest.mark.parametrize("name", CASES)
def test_alert_fires_only_when_its_condition_breaks(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    rule = rules()[case.alert]
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": name,
                "interval": "1m",
                "input_series": case.series,
                "alert_rule_test": [
                    {
                        "eval_time": EVAL_TIME,
                        "alertname": case.alert,
                        "exp_alerts": expected_alerts(rule) if case.fires else [],
                    }
                ],
            }
        ],
    }
    test_file = tmp_path / "alerts.test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run_promtool("test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_and_dashboard_queries_parse(tmp_path: Path) -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    queries = list(dashboard_queries(DASHBOARD))
    assert len(queries) > 30
    checked = tmp_path / "dashboard.rules.yaml"
    checked.write_text(yaml.safe_dump(as_rules_file(iter(queries))))
    result = run_promtool("check", "rules", str(checked))
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(list(rule_queries(RULES))) == len(rules())


def test_slo_targets_are_histogram_bounds() -> None:
    # "Within the target" counts a bucket exactly, so a target must be a bucket bound:
    # the chart's schema and the dashboard's choices follow the workers' histograms.
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["alerts"]["properties"]["ttftTargetSeconds"]["enum"] == list(
        LATENCY_BUCKETS
    )
    dashboard = json.loads(DASHBOARD.read_text())
    choices = {v["name"]: v["query"] for v in dashboard["templating"]["list"]}
    for name in ("ttft_target", "tpot_target"):
        assert {float(value) for value in choices[name].split(",")} <= set(LATENCY_BUCKETS)


CLIENT_LATENCY = re.compile(
    r"pdserve_(?:time_to_first_token|inter_token_latency|e2e_request_latency|time_per_output_token)"
    r"_seconds_\w+(\{[^}]*\})?"
)


def test_client_latency_is_read_from_the_router() -> None:
    # Summed over every role, a request would count at the router and again at each
    # worker it passed, and percentiles would mix what clients saw with what workers did.
    queries = [*dashboard_queries(DASHBOARD), *rule_queries(RULES)]
    selections = [
        (where, found) for where, query in queries for found in CLIENT_LATENCY.finditer(query)
    ]
    assert len(selections) > 20
    over_every_role = [
        f"{where}: {found.group(0)}"
        for where, found in selections
        if 'role="router"' not in (found.group(1) or "")
    ]
    assert not over_every_role, over_every_role
