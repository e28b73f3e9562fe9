"""Finding the metric names in PromQL, and the names a /metrics page exports."""

from __future__ import annotations

import pytest

from support.promql import exported_names, from_grafana, metric_names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('rate(x_total{job="a", le=~"2(\\\\.0)?"}[5m] offset 1h)', {"x_total"}),
        (
            "histogram_quantile(0.99, sum by (namespace, pool, le) (rate(a_bucket[5m]))) > 0.05",
            {"a_bucket"},
        ),
        ("sum without (instance) (b) / on (pool) group_left (role) c", {"b", "c"}),
        ("a > 2 * b + 0.01 and on (ns) c unless d or e", {"a", "b", "c", "d", "e"}),
        ('{__name__="by_name", pool="p"}', {"by_name"}),
        ('count(x{a="}"}) by (sum)', {"x"}),
        ("sum(rate(x[1m])) # a comment naming y\n+ z", {"x", "z"}),
        ("topk(3, x) + vector(1) + scalar(y) + time()", {"x", "y"}),
        ("x @ 1609746000 + y offset -5m", {"x", "y"}),
        ("1e3 * inf + NaN", set()),
        ("pdserve:ttft:p95 > 1", {"pdserve:ttft:p95"}),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_grafana_variables_become_promql() -> None:
    query = 'sum(rate(x{pool=~"$pool", le="$ttft_target"}[$__rate_interval]))'
    assert from_grafana(query) == 'sum(rate(x{pool=~".*", le="2.0"}[5m]))'


def test_exported_names_come_from_type_lines() -> None:
    page = "\n".join([
        "# HELP c_total A counter.", "# TYPE c_total counter",
        "# HELP h A histogram.", "# TYPE h histogram",
        "# TYPE g gauge", "g 1.0",
    ])  # fmt: skip
    assert exported_names(page) == {
        "c_total", "c_created", "h_bucket", "h_sum", "h_count", "h_created", "g",
    }  # fmt: skip
