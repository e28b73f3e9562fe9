"""The router's per-request metrics, counted in plain numbers (`tallies`), expose the
very series prometheus_client's own Counter and Histogram would: names, types, help,
labels, bucket bounds and values, `_created` included."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdserve.protocol.routing import Slo
from pdserve.workers.metric_labels import LATENCY_BUCKETS
from pdserve.workers.router import kv_metrics, metrics
from pdserve.workers.router.kv_metrics import KVRoutingMetrics
from pdserve.workers.router.metrics import RouterMetrics
from pdserve.workers.router.tallies import PlainCounter, PlainHistogram

_CREATED = re.compile(r"^(\S+_created(?:\{.*\})?) \S+$", re.MULTILINE)


def exposition(registry: CollectorRegistry) -> str:
    """The registry's /metrics text, each `_created` time replaced by a mark."""
    return _CREATED.sub(r"\1 T", generate_latest(registry).decode())


def _as_counter(
    name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
) -> Counter:
    return Counter(name, documentation, labelnames, registry=registry)


def _as_histogram(
    name: str,
    documentation: str,
    labelnames: Sequence[str],
    registry: CollectorRegistry,
    buckets: Sequence[float],
) -> Histogram:
    return Histogram(name, documentation, labelnames, registry=registry, buckets=buckets)


def _serve_some(router: RouterMetrics, kv: KVRoutingMetrics) -> None:
    """What a few requests count: streamed, whole, cancelled, two buckets, revisions,
    latencies on bucket bounds, and the KV decisions."""
    slo = Slo(ttft_seconds=0.05, itl_seconds=0.01)
    for bucket, mode in (("short", "colocated"), ("long", "disaggregated"), ("short", "colocated")):
        router.decided(bucket, mode)
    router.observe_request("short", "colocated", "ok", 0.0, [[0.001, 0.0035, 0.0135]], 0.02, slo)
    router.observe_request(
        "long", "disaggregated", "ok", 1.0, [[1.04, 1.05], [1.045, 1.2, 1.3]], 1.31, slo,
        revisions=("p-1", "d-2"),
    )  # fmt: skip
    router.observe_request("short", "colocated", "ok", 0.0, [], 100.0, slo, output_tokens=4)
    router.observe_request("short", "colocated", "cancelled", 0.0, [[0.5]], 0.6, slo)
    router.observe_request("short", "colocated", "invalid", 0.0, [], 0.001, slo)
    kv.chose("decode", "cache", 100, 32)
    kv.chose("decode", "load", 50, 0)
    kv.chose("prefill", "none", 70, 0)
    kv.observed("decode", 32, 32)
    kv.observed("decode", 32, 16)
    kv.observed("decode", 0, None)
    kv.decided_mode("disaggregated", "colocated")


def _router(registry: CollectorRegistry | None = None) -> tuple[RouterMetrics, KVRoutingMetrics]:
    router = RouterMetrics("pool-a", registry)
    return router, KVRoutingMetrics("pool-a", router.registry)


def test_the_router_exposes_what_prometheus_client_would(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _router()
    with monkeypatch.context() as patched:
        # The same router, its plain families made by prometheus_client instead.
        patched.setattr(metrics, "PlainCounter", _as_counter)
        patched.setattr(metrics, "PlainHistogram", _as_histogram)
        patched.setattr(kv_metrics, "PlainCounter", _as_counter)
        theirs = _router()
    assert isinstance(ours[0].itl, PlainHistogram) and isinstance(theirs[0].itl, Histogram)
    assert exposition(ours[0].registry) == exposition(theirs[0].registry)  # nothing counted
    for router, kv in (ours, theirs):
        _serve_some(router, kv)
    text = exposition(ours[0].registry)
    assert text == exposition(theirs[0].registry)
    assert 'pdserve_inter_token_latency_seconds_bucket{bucket="long",' in text
    assert "pdserve_router_kv_predictions_total{" in text


def _twins(
    make: Callable[[CollectorRegistry], Any], reference: Callable[[CollectorRegistry], Any]
) -> tuple[Any, Any, CollectorRegistry, CollectorRegistry]:
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    return make(mine), reference(theirs), mine, theirs


@pytest.mark.parametrize(
    "amounts",
    [
        [0.0, *LATENCY_BUCKETS, 80.0001, 1e9],  # every bound exactly, and beyond the last
        [-1.0, 0.0005, 0.00100001, 2.5e-3],
        [math.inf, 0.3],
    ],
)
def test_a_histogram_counts_as_prometheus_client_does(amounts: list[float]) -> None:
    ours, theirs, mine, reference = _twins(
        lambda r: PlainHistogram("h_seconds", "A histogram.", ("a", "b"), r, LATENCY_BUCKETS),
        lambda r: Histogram("h_seconds", "A histogram.", ("a", "b"), registry=r,
                            buckets=LATENCY_BUCKETS),
    )  # fmt: skip
    for amount in amounts:
        ours.labels("x", "y").observe(amount)
        theirs.labels("x", "y").observe(amount)
        ours.labels(a="z", b="y").observe(amount / 2)
        theirs.labels(a="z", b="y").observe(amount / 2)
    assert exposition(mine) == exposition(reference)


def test_a_nan_goes_in_no_bucket_but_in_the_sum() -> None:
    ours, theirs, mine, reference = _twins(
        lambda r: PlainHistogram("h", "A histogram.", ("a",), r, (0.1, 1.0)),
        lambda r: Histogram("h", "A histogram.", ("a",), registry=r, buckets=(0.1, 1.0)),
    )
    for histogram in (ours, theirs):
        histogram.labels("x").observe(0.05)
        histogram.labels("x").observe(math.nan)
    assert exposition(mine) == exposition(reference)


def test_a_counter_counts_as_prometheus_client_does() -> None:
    ours, theirs, mine, reference = _twins(
        lambda r: PlainCounter("c_total", "A counter.", ("a",), r),
        lambda r: Counter("c_total", "A counter.", ("a",), registry=r),
    )
    for counter in (ours, theirs):
        counter.labels("x").inc()
        counter.labels(a="x").inc(2.5)
        counter.labels("y").inc(0)
    assert exposition(mine) == exposition(reference)
    with pytest.raises(ValueError):
        ours.labels("x").inc(-1)


def test_labels_must_be_the_familys() -> None:
    counter = PlainCounter("c_total", "A counter.", ("a", "b"), CollectorRegistry())
    for wrong in ((("x",), {}), ((), {"a": "x"}), (("x",), {"b": "y"}), ((), {"a": "x", "c": "y"})):
        with pytest.raises(ValueError, match="the labels are"):
            counter.labels(*wrong[0], **wrong[1])


def test_a_name_registered_twice_is_refused() -> None:
    registry = CollectorRegistry()
    PlainCounter("c_total", "A counter.", ("a",), registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("c", "The same name.", ("a",), registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        PlainHistogram("c", "The same name.", (), registry, (1.0,))
