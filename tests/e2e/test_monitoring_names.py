"""The dashboard and the alert rules name only metrics pdserve exports: every metric
name in their PromQL is on the /metrics page of a real process (workers and the
operator; the router joins SCRAPED when it exists). Names come from the pages' `#
TYPE` lines, so a labelled metric counts before its first sample.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from support.chart import CHART, DEPLOY
from support.operator import Cluster, OperatorProcess, install_crd, operator_kubeconfig
from support.promql import dashboard_queries, exported_names, metric_names, rule_queries
from support.worker import running_worker

pytestmark = pytest.mark.cluster

Started = Callable[[Path], AbstractContextManager[str]]  # a process' /metrics URL


def page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
        return text


@pytest.fixture(scope="module")
def exported(
    cluster: Cluster, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, set[str]]:
    """The names on each scraped component's /metrics page."""

    @contextmanager
    def worker(logs: Path) -> Iterator[str]:
        with running_worker(small_model_dir, logs, "--max-model-len", "256") as process:
            yield f"{process.url}/metrics"

    @contextmanager
    def operator(logs: Path) -> Iterator[str]:
        install_crd(cluster)
        namespace = f"names-{uuid.uuid4().hex[:6]}"
        cluster.kubectl("create", "namespace", namespace)
        kubeconfig = operator_kubeconfig(cluster, logs / "kubeconfig")
        process = OperatorProcess(kubeconfig, logs / "operator.log", [namespace]).start()
        try:
            yield f"http://127.0.0.1:{process.port}/metrics"
        finally:
            process.stop()
            cluster.kubectl("delete", "namespace", namespace, "--wait=false")

    scraped: dict[str, Started] = {"worker": worker, "operator": operator}
    names = {}
    for component, start in scraped.items():
        with start(tmp_path_factory.mktemp(component)) as url:
            names[component] = exported_names(page(url))
    return names


def queries() -> Iterator[tuple[str, str]]:
    yield from dashboard_queries(CHART / "files" / "grafana-dashboard.json")
    yield from rule_queries(DEPLOY / "monitoring" / "alerts.rules.yaml")


def test_every_queried_metric_is_exported(exported: dict[str, set[str]]) -> None:
    known = set().union(*exported.values())
    unknown = {
        where: sorted(metric_names(query) - known)
        for where, query in queries()
        if metric_names(query) - known
    }
    assert not unknown, f"queries name metrics no component exports: {unknown}"
    # Each component's metrics are on the dashboard.
    used = set().union(*(metric_names(query) for _, query in queries()))
    for component, names in exported.items():
        assert used & names, f"the dashboard shows nothing of the {component}"
