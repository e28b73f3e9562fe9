"""The router's Prometheus metrics. Latencies carry the workers' names and buckets
(`pdserve_time_to_first_token_seconds`, ...) with role="router", labelled by the
routing table's bucket and the mode a request was served in; the rest say what the
router decided and how it coped: routing decisions, retries, fallbacks to colocated,
goodput against the pool's SLOs, and the workers it knows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.protocol.api_errors import APIError
from pdserve.protocol.routing import Slo
from pdserve.workers.metric_labels import LATENCY_BUCKETS, rejection_reason
from pdserve.workers.router.tallies import (
    CounterChild,
    HistogramChild,
    PlainCounter,
    PlainHistogram,
)

ROLE = "router"


@dataclass(frozen=True)
class _PathChildren:
    """The metrics of one bucket, mode and pair of revisions, their labels bound once
    (a label lookup per request and per token is a large share of the router's time)."""

    ttft: HistogramChild
    itl: HistogramChild
    tpot: HistogramChild
    e2e: HistogramChild
    slo_met: CounterChild
    requests: dict[str, CounterChild]  # by outcome, bound as each is first seen


class RouterMetrics:
    """All metrics of one router, in a registry of their own. Those counted per request
    are plain numbers (`tallies`), exposed as prometheus_client would expose them."""

    def __init__(self, pool: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = reg = registry or CollectorRegistry()
        self.pool = pool
        base = ("pool", "role")
        decided = (*base, "bucket", "mode")
        # Per request: the revisions of the workers that served it (empty: none, or no
        # rollout), so a canary's figures are told from the stable revision's.
        labeled = (*decided, "prefill_revision", "decode_revision")

        def histogram(name: str, text: str) -> PlainHistogram:
            return PlainHistogram(name, text, labeled, reg, LATENCY_BUCKETS)

        self.ttft = histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival at the router to its first token leaving it (streamed requests).",
        )
        self.itl = histogram(
            "pdserve_inter_token_latency_seconds",
            "Every gap between consecutive tokens of a choice the router relayed.",
        )
        self.tpot = histogram(
            "pdserve_time_per_output_token_seconds",
            "Per streamed request: (last - first token) / (output tokens - 1), the mean "
            "over its choices.",
        )
        self.e2e = histogram(
            "pdserve_e2e_request_latency_seconds", "Request arrival to its last byte."
        )
        self.requests = PlainCounter(
            "pdserve_router_requests_total",
            "Requests the router routed, each under one outcome when it ended, by bucket, "
            "mode served and outcome (ok; error: no worker could answer, or its answer "
            "failed; invalid: refused as the client's fault; cancelled: the client went "
            "away first).",
            (*labeled, "outcome"), reg,
        )  # fmt: skip
        self.decisions = PlainCounter(
            "pdserve_router_decisions_total",
            "Routing decisions: the path the routing table chose for each request.",
            decided, reg,
        )  # fmt: skip
        self.retries = Counter(
            "pdserve_router_retries_total",
            "Attempts retried on another worker before the first token, by cause.",
            (*base, "reason"), registry=reg,
        )  # fmt: skip
        self.fallbacks = Counter(
            "pdserve_router_fallbacks_total",
            "Disaggregated requests served colocated: no prefill worker was healthy "
            "(no_prefill) or the hand-off failed (handoff_failed).",
            (*base, "bucket", "reason"), registry=reg,
        )  # fmt: skip
        self.handoffs_skipped = Counter(
            "pdserve_router_handoffs_skipped_total",
            "Disaggregated requests their decode worker served colocated because its "
            "prefix cache held the prompt but for the tokens the pool serves colocated "
            "(KV-aware routing; neither a fallback nor the prefill worker's failure).",
            (*base, "bucket"), registry=reg,
        )  # fmt: skip
        self.slo_met = PlainCounter(
            "pdserve_router_slo_met_total",
            "Requests that met every SLO of the pool (goodput is its rate).",
            labeled, reg,
        )  # fmt: skip
        self.rejected = Counter(
            "pdserve_requests_rejected_total",
            "Requests the router answered with an error status, by reason.",
            (*base, "reason"), registry=reg,
        )  # fmt: skip
        self.workers = Gauge(
            "pdserve_router_workers",
            "Workers the router knows, by their role (target) and whether they take "
            "traffic (state: available, or unavailable while their circuit breaker is open).",
            (*base, "target", "state"), registry=reg,
        )  # fmt: skip
        self.reloads = Counter(
            "pdserve_router_config_reloads_total",
            "Re-reads of a changed routing file, by result (applied or refused).",
            (*base, "result"), registry=reg,
        )  # fmt: skip
        self._paths: dict[tuple[str, str, str, str], _PathChildren] = {}
        self._decisions: dict[tuple[str, str], CounterChild] = {}

    def _labels(self, **extra: str) -> dict[str, str]:
        return {"pool": self.pool, "role": ROLE, **extra}

    def _path(self, bucket: str, mode: str, revisions: tuple[str, str]) -> _PathChildren:
        key = (bucket, mode, *revisions)
        children = self._paths.get(key)
        if children is None:
            labels = self._labels(
                bucket=bucket, mode=mode, prefill_revision=revisions[0],
                decode_revision=revisions[1],
            )  # fmt: skip
            children = _PathChildren(
                self.ttft.labels(**labels), self.itl.labels(**labels),
                self.tpot.labels(**labels), self.e2e.labels(**labels),
                self.slo_met.labels(**labels), {},
            )  # fmt: skip
            self._paths[key] = children
        return children

    def decided(self, bucket: str, mode: str) -> None:
        """Count a routing decision (made before a worker, so a revision, is chosen)."""
        counter = self._decisions.get((bucket, mode))
        if counter is None:
            labels = self._labels(bucket=bucket, mode=mode)
            counter = self._decisions[(bucket, mode)] = self.decisions.labels(**labels)
        counter.inc()

    def retried(self, reason: str) -> None:
        """Count a retry."""
        self.retries.labels(**self._labels(reason=reason)).inc()

    def fell_back(self, bucket: str, reason: str) -> None:
        """Count a disaggregated request served colocated."""
        self.fallbacks.labels(**self._labels(bucket=bucket, reason=reason)).inc()

    def handoff_skipped(self, bucket: str) -> None:
        """Count a disaggregated request its decode worker's cache let it serve
        colocated."""
        self.handoffs_skipped.labels(**self._labels(bucket=bucket)).inc()

    def reloaded(self, applied: bool) -> None:
        """Count a re-read of the routing file."""
        self.reloads.labels(**self._labels(result="applied" if applied else "refused")).inc()

    def observe_error(self, error: APIError) -> None:
        """Count a request answered with an error status."""
        self.rejected.labels(**self._labels(reason=rejection_reason(error))).inc()

    def set_workers(self, target: str, available: int, unavailable: int) -> None:
        """The workers of a role the router knows."""
        self.workers.labels(**self._labels(target=target, state="available")).set(available)
        self.workers.labels(**self._labels(target=target, state="unavailable")).set(unavailable)

    def observe_request(
        self,
        bucket: str,
        mode: str,
        outcome: str,
        arrival: float,
        streams: Sequence[Sequence[float]],
        ended: float,
        slo: Slo,
        output_tokens: int | None = None,
        revisions: tuple[str, str] = ("", ""),
    ) -> None:
        """Record a request that ended. `streams`: for each choice that streamed tokens,
        the times they left the router (none for an answer sent whole, which gives
        `output_tokens`, per choice). TTFT is the first token of any choice, ITL every
        gap within a choice, TPOT the mean of the choices'. `revisions`: the prefill
        and decode workers' that served it."""
        path = self._path(bucket, mode, revisions)
        requests = path.requests.get(outcome)
        if requests is None:
            labels = self._labels(
                bucket=bucket, mode=mode, prefill_revision=revisions[0],
                decode_revision=revisions[1], outcome=outcome,
            )  # fmt: skip
            requests = path.requests[outcome] = self.requests.labels(**labels)
        requests.inc()
        if outcome != "ok":
            return
        path.e2e.observe(ended - arrival)
        if not streams:
            if _whole_meets_slo(slo, ended - arrival, output_tokens):
                path.slo_met.inc()
            return
        ttft = first_token(streams) - arrival
        path.ttft.observe(ttft)
        itl = path.itl.observe
        for times in streams:
            for earlier, later in pairwise(times):
                itl(later - earlier)
        tpot = time_per_output_token(streams)
        if tpot is not None:
            path.tpot.observe(tpot)
        if _streamed_meets_slo(slo, ttft, tpot):
            path.slo_met.inc()


def first_token(streams: Sequence[Sequence[float]]) -> float:
    """When the first token of any choice left."""
    if len(streams) == 1:
        return streams[0][0]
    return min(times[0] for times in streams)


def time_per_output_token(streams: Sequence[Sequence[float]]) -> float | None:
    """The mean over the choices of (last - first token) / (tokens - 1); None when no
    choice had two tokens."""
    if len(streams) == 1:
        times = streams[0]
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    tpots = [(times[-1] - times[0]) / (len(times) - 1) for times in streams if len(times) > 1]
    return sum(tpots) / len(tpots) if tpots else None


def meets_slo(
    slo: Slo,
    arrival: float,
    streams: Sequence[Sequence[float]],
    ended: float,
    output_tokens: int | None,
) -> bool:
    """Whether a request met the pool's targets: TTFT, and TPOT against the ITL target
    (as vLLM's goodput does). An answer sent whole meets them when it came within the
    time its tokens were allowed: TTFT + ITL x (tokens per choice - 1); its choices
    decode side by side."""
    if streams:
        ttft = first_token(streams) - arrival
        return _streamed_meets_slo(slo, ttft, time_per_output_token(streams))
    return _whole_meets_slo(slo, ended - arrival, output_tokens)


def _streamed_meets_slo(slo: Slo, ttft: float, tpot: float | None) -> bool:
    ttft_ok = slo.ttft_seconds is None or ttft <= slo.ttft_seconds
    tpot_ok = slo.itl_seconds is None or tpot is None or tpot <= slo.itl_seconds
    return ttft_ok and tpot_ok


def _whole_meets_slo(slo: Slo, took: float, output_tokens: int | None) -> bool:
    ttft_target = math.inf if slo.ttft_seconds is None else slo.ttft_seconds
    itl_target = math.inf if slo.itl_seconds is None else slo.itl_seconds
    gaps = max(0, (output_tokens or 1) - 1)
    allowed = ttft_target + (itl_target * gaps if gaps else 0.0)
    return took <= allowed
