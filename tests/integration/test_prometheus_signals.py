"""The autoscaler's view of a pool, read from a real Prometheus scraping a real
worker: latencies, traffic and load as the planner gets them; no data and an
unreachable Prometheus as errors that say so."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from pdserve.operator import api
from pdserve.operator.local.promserver import PrometheusServer
from pdserve.operator.scaling.prometheus import PrometheusError
from pdserve.operator.scaling.promql import PoolQueries
from pdserve.operator.scaling.signals import NoMetricsError, PoolSignals, read
from pdserve.workers.faults import Fault
from support.network import refusing_url
from support.prometheus import ask, host_port, running_prometheus
from support.waiting import wait_until
from support.worker import ServerProcess, running_worker

STALL_S = 0.1  # every engine step: each gap between tokens is at least this long
REQUESTS, TOKENS = 6, 6
# Longer than the module runs, however loaded the machine: every request the test sent
# stays in the window (its Prometheus is the module's own, so nothing else is there).
WINDOW_S = 900.0
SLO = api.SloSpec(
    ttft=api.LatencyTarget(seconds=1.0, percentile=50),
    itl=api.LatencyTarget(seconds=0.05, percentile=50),
)


@pytest.fixture(scope="module")
def worker(
    small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    stall = {"engine.step": Fault(delay_s=STALL_S)}
    logs = tmp_path_factory.mktemp("worker")
    with running_worker(small_model_dir, logs, "--pool", "chat", faults=stall) as process:
        yield process


@pytest.fixture(scope="module")
def prometheus(
    worker: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrometheusServer]:
    run_dir = tmp_path_factory.mktemp("prometheus")
    with running_prometheus(run_dir, [host_port(worker.url)]) as server:
        # A labelled series exists from its first observation on, and Prometheus counts
        # increases only from its first scrape of it: make the series, then see them.
        stream(worker, -1)
        ttft_count = 'pdserve_time_to_first_token_seconds_count{pool="chat"}'
        wait_until(lambda: ask(server.url, lambda c: c.value(ttft_count)), 60, "a scrape")
        yield server


def stream(worker: ServerProcess, index: int) -> int:
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
    chunks = client.completions.create(
        model="small-llama", prompt=f"request {index}", max_tokens=TOKENS, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return sum(1 for _ in chunks)


def signals_of(prometheus: PrometheusServer, pool: str = "chat") -> PoolSignals:
    queries = PoolQueries(pool, window_seconds=WINDOW_S)
    return ask(prometheus.url, lambda client: read(client, queries, SLO))


def test_signals_show_the_pool_latencies_traffic_and_load(
    worker: ServerProcess, prometheus: PrometheusServer
) -> None:
    with ThreadPoolExecutor(REQUESTS) as pool:
        assert list(pool.map(lambda i: stream(worker, i), range(REQUESTS))) == [TOKENS] * REQUESTS

    def counted() -> PoolSignals | None:
        # First tokens come a stalled step before the gaps: a scrape between them counts
        # the requests while no gap has been seen yet, so wait for both.
        seen = signals_of(prometheus)
        requests, itl = seen.observation.requests or 0, seen.observation.itl
        return seen if requests >= REQUESTS * 0.9 and itl is not None else None

    observation = wait_until(counted, 60, "Prometheus to see the requests").observation
    assert observation.itl is not None and observation.itl >= STALL_S
    assert observation.ttft["colocated"] >= STALL_S  # prefill takes a stalled step too
    assert "disaggregated" not in observation.ttft
    assert observation.request_rate is not None and observation.request_rate > 0
    assert observation.decode is not None and observation.decode.workers == 1
    assert observation.prefill is None


def test_a_pool_prometheus_does_not_scrape_has_no_metrics(prometheus: PrometheusServer) -> None:
    with pytest.raises(NoMetricsError, match="has no series of pool elsewhere"):
        signals_of(prometheus, "elsewhere")


def test_an_unreachable_prometheus_is_an_error_that_names_it() -> None:
    with refusing_url() as url, pytest.raises(PrometheusError, match=f"cannot reach {url}"):
        ask(url, lambda client: read(client, PoolQueries("chat"), SLO))


def test_a_refused_query_is_an_error_with_prometheus_reason(prometheus: PrometheusServer) -> None:
    with pytest.raises(PrometheusError, match="bad_data"):
        ask(prometheus.url, lambda client: client.query("sum(("))
