"""Counters and histograms counted in plain numbers and exposed at scrape time.

`prometheus_client` takes a lock and walks its bucket bounds in Python on every
observation; the router observes several per request, on one event loop's thread,
so its per-request metrics are kept here instead: a child per label set holds plain
floats, and the family turns them into the same series `prometheus_client`'s own
`Counter` and `Histogram` expose (names, types, labels, bucket bounds, `_created`),
when the registry is collected. Not for metrics updated from several threads.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


def _exposes_created() -> bool:
    """Whether `_created` series are exposed (the library's switch, which its own
    metrics read: PROMETHEUS_DISABLE_CREATED_SERIES)."""
    return bool(getattr(metrics, "_use_created", True))


class CounterChild:
    """One label set's count."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount` (not negative)."""
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramChild:
    """One label set's observations, counted per bucket (not cumulative)."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # ending with +Inf
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count `amount` in the first bucket whose bound is not below it."""
        self.sum += amount
        if amount == amount:  # a NaN goes in no bucket, as in prometheus_client
            self.counts[bisect_left(self.bounds, amount)] += 1.0


Child = TypeVar("Child", CounterChild, HistogramChild)


class _Family(Collector, Generic[Child]):
    """A metric with labels whose children are plain numbers."""

    kind = ""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def labels(self, *values: str, **named: str) -> Child:
        """The child of one label set (made on first use, as it stays)."""
        key = self._key(values, named)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _new_child(self) -> Child:
        raise NotImplementedError

    def _key(self, values: tuple[str, ...], named: dict[str, str]) -> tuple[str, ...]:
        if named:
            if values or set(named) != set(self.labelnames):
                raise ValueError(f"{self.name}: the labels are {self.labelnames}")
            return tuple(str(named[label]) for label in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: the labels are {self.labelnames}")
        return tuple(str(value) for value in values)

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def _labelled(self, values: tuple[str, ...], **extra: str) -> dict[str, str]:
        return {**dict(zip(self.labelnames, values, strict=True)), **extra}


class PlainCounter(_Family[CounterChild]):
    """A counter family (`name` without `_total`, as prometheus_client names it)."""

    kind = "counter"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def collect(self) -> list[Metric]:
        family = Metric(self.name, self.documentation, self.kind)
        created = _exposes_created()
        for values, child in list(self._children.items()):
            labels = self._labelled(values)
            family.add_sample(f"{self.name}_total", labels, child.value)
            if created:
                family.add_sample(f"{self.name}_created", labels, child.created)
        return [family]


class PlainHistogram(_Family[HistogramChild]):
    """A histogram family with fixed bucket bounds (+Inf added, as prometheus_client
    adds it)."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        bounds = [float(bound) for bound in buckets]
        if bounds != sorted(bounds):
            raise ValueError("buckets not in sorted order")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        # The `le` label as prometheus_client writes a bound (1.0, +Inf).
        self._names = tuple(str(floatToGoString(bound)) for bound in self.bounds)  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def collect(self) -> list[Metric]:
        family = Metric(self.name, self.documentation, self.kind)
        created = _exposes_created()
        for values, child in list(self._children.items()):
            labels = self._labelled(values)
            total = 0.0
            for le, count in zip(self._names, list(child.counts), strict=True):
                total += count
                family.add_sample(f"{self.name}_bucket", self._labelled(values, le=le), total)
            family.add_sample(f"{self.name}_count", labels, total)
            if self.bounds[0] >= 0:
                family.add_sample(f"{self.name}_sum", labels, child.sum)
            if created:
                family.add_sample(f"{self.name}_created", labels, child.created)
        return [family]
