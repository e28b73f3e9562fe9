"""The dashboard and the alert rules name only metrics pdserve exports: every metric
name in their PromQL is on the /metrics page of a real process (a worker, the router
in front of it, the operator), and every metric of the router's own is on the
dashboard. Names come from the pages' `# TYPE` lines, so a labelled metric counts
before its first sample.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from render_deploy import CHART, DEPLOY
from support.operator import Cluster, OperatorProcess, install_crd, operator_kubeconfig
from support.promql import dashboard_queries, exported_names, metric_names, rule_queries
from support.router import running_router, static_routing_file
from support.worker import running_worker

pytestmark = pytest.mark.cluster

# Started processes' /metrics URLs, by component.
Started = Callable[[Path], AbstractContextManager[dict[str, str]]]
DASHBOARD = CHART / "files" / "grafana-dashboard.json"


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
    def worker_and_router(logs: Path) -> Iterator[dict[str, str]]:
        with (
            running_worker(small_model_dir, logs, "--max-model-len", "256") as worker,
            running_router(
                static_routing_file(logs, small_model_dir, worker.url, "names"),
                logs / "router.log",
            ) as router,
        ):
            router.wait_ready()
            yield {"worker": f"{worker.url}/metrics", "router": f"{router.url}/metrics"}

    @contextmanager
    def operator(logs: Path) -> Iterator[dict[str, str]]:
        install_crd(cluster)
        namespace = f"names-{uuid.uuid4().hex[:6]}"
        cluster.kubectl("create", "namespace", namespace)
        kubeconfig = operator_kubeconfig(cluster, logs / "kubeconfig")
        process = OperatorProcess(kubeconfig, logs / "operator.log", [namespace]).start()
        try:
            yield {"operator": f"http://127.0.0.1:{process.port}/metrics"}
        finally:
            process.stop()
            cluster.kubectl("delete", "namespace", namespace, "--wait=false")

    scraped: dict[str, Started] = {"pool": worker_and_router, "operator": operator}
    names: dict[str, set[str]] = {}
    for part, start in scraped.items():
        with start(tmp_path_factory.mktemp(part)) as urls:
            names |= {component: exported_names(page(url)) for component, url in urls.items()}
    return names


def queries() -> Iterator[tuple[str, str]]:
    yield from dashboard_queries(DASHBOARD)
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


def family(sample: str) -> str:
    """The metric a sample name belongs to (`_total`, `_bucket`, ... removed)."""
    for suffix in ("_total", "_created", "_bucket", "_sum", "_count"):
        if sample.endswith(suffix):
            return sample.removesuffix(suffix)
    return sample


def test_the_dashboard_shows_every_router_metric(exported: dict[str, set[str]]) -> None:
    queried = {
        family(name) for _, query in dashboard_queries(DASHBOARD) for name in metric_names(query)
    }
    routers_own = {
        family(name) for name in exported["router"] if name.startswith("pdserve_router_")
    }
    assert routers_own, "the router's page shows no metric of its own"
    assert routers_own <= queried, f"not on the dashboard: {sorted(routers_own - queried)}"
