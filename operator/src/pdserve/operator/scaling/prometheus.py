"""A small client of Prometheus' HTTP API: instant queries, answered as samples.

Errors are one exception, PrometheusError, whose message says what went wrong in a
user's words (cannot connect, timed out, an error status, a query refused), since it
ends up in a pool's conditions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

QUERY_PATH = "/api/v1/query"


class PrometheusError(Exception):
    """Prometheus could not be asked, or refused the question."""


@dataclass(frozen=True)
class Sample:
    """One element of an instant vector (or a scalar, with no labels)."""

    labels: Mapping[str, str]
    value: float  # may be NaN (e.g. a quantile of no observations)


def _value(raw: Any) -> float:
    try:
        return float(raw[1])
    except (TypeError, ValueError, IndexError) as error:
        raise PrometheusError(f"unexpected sample {raw!r}") from error


def parse_answer(answer: Any) -> list[Sample]:
    """The samples of a /api/v1/query answer; PrometheusError for an error answer."""
    if not isinstance(answer, dict):
        raise PrometheusError("the answer is not a JSON object")
    if answer.get("status") != "success":
        raise PrometheusError(f"{answer.get('errorType', 'error')}: {answer.get('error', '?')}")
    data = answer.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind in ("scalar", "string"):
        return [Sample({}, _value(result))]
    if kind != "vector" or not isinstance(result, list):
        raise PrometheusError(f"expected an instant vector, got {kind!r}")
    return [Sample(dict(item.get("metric", {})), _value(item.get("value"))) for item in result]


class Prometheus:
    """Instant queries against one Prometheus server."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def query(self, expr: str) -> list[Sample]:
        """The instant vector `expr` evaluates to now."""
        try:
            async with self._session.get(
                self.url + QUERY_PATH, params={"query": expr}, timeout=self._timeout
            ) as response:
                try:
                    answer = await response.json(content_type=None)
                except ValueError:
                    answer = None
                if response.status >= 400 and not isinstance(answer, dict):
                    raise PrometheusError(f"{self.url} answered {response.status}")
        except aiohttp.ClientError as error:
            raise PrometheusError(f"cannot reach {self.url}: {error}") from error
        except TimeoutError as error:
            raise PrometheusError(f"{self.url} did not answer in time") from error
        return parse_answer(answer)

    async def value(self, expr: str) -> float | None:
        """The single number `expr` gives (None: no sample, or NaN)."""
        samples = await self.query(expr)
        return finite(samples[0].value) if samples else None

    async def by_label(self, expr: str, label: str) -> dict[str, float]:
        """The finite values of `expr`, keyed by one of their labels."""
        out = {}
        for sample in await self.query(expr):
            value = finite(sample.value)
            if value is not None:
                out[sample.labels.get(label, "")] = value
        return out


def finite(value: float) -> float | None:
    """A number, or None for NaN and infinities (a quantile of nothing, or past the
    last bucket: no number to act on)."""
    return value if math.isfinite(value) else None
