"""Reading Prometheus text exposition with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample at `url` (a /metrics endpoint): (name, labels, value)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(
        value
        for sample_name, sample_labels, value in scrape(url)
        if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
    )
