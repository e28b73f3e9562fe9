"""The `DisaggregationActive` condition: whether the pool really serves its
disaggregated buckets through prefill workers (pure).

True only while requests of disaggregated buckets complete with a successful KV
transfer in the recent window. A pool whose router silently falls back to colocated
serving (no prefill worker, transfers failing) would still answer every request,
and look healthy by every other measure: this condition is where that shows.

  True     Disaggregating          transfers complete (the message gives the share
                                   that fell back, if any)
  False    NoPrefillWorkerReady    the router has no prefill worker to send to
  False    TransfersFailing        every hand-off in the window failed
  False    AllFallingBack          requests fell back to colocated, none completed
                                   a transfer
  False    NoDisaggregatedCompletions  requests took the path, none completed
  Unknown  NoDisaggregatedTraffic  no request took a disaggregated bucket
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.operator.controller.status import Verdict


@dataclass(frozen=True)
class Signals:
    """Rates over the window (per second; None: no series) and the prefill workers
    available now."""

    routed: float | None = None  # requests sent down a disaggregated bucket's path
    served: float | None = None  # of them, answered disaggregated
    fallbacks: Mapping[str, float] = field(default_factory=dict)  # by reason
    transfers: float | None = None  # KV transfers completed
    failures: Mapping[str, float] = field(default_factory=dict)  # hand-offs failed, by cause
    prefill_available: float | None = None


def _per_second(value: float) -> str:
    return f"{value:.3g}/s"


def _by_reason(rates: Mapping[str, float]) -> str:
    parts = [f"{reason or 'unknown'} {_per_second(rate)}" for reason, rate in sorted(rates.items())]
    return ", ".join(parts)


def verdict(signals: Signals, window_seconds: float) -> Verdict:
    """The condition from the window's signals."""
    window = f"in the last {window_seconds:g}s"
    fallbacks = {k: v for k, v in signals.fallbacks.items() if v > 0}
    failures = {k: v for k, v in signals.failures.items() if v > 0}
    transfers = signals.transfers or 0.0
    if not signals.prefill_available:
        return Verdict(
            "False", "NoPrefillWorkerReady",
            "no prefill worker is ready: disaggregated buckets are served colocated",
        )  # fmt: skip
    traffic = signals.routed
    if traffic is None:  # no router reports: the workers' transfers tell
        traffic = transfers + sum(failures.values())
    if traffic <= 0:
        return Verdict("Unknown", "NoDisaggregatedTraffic", f"no disaggregated request {window}")
    if transfers > 0 and (signals.served is None or signals.served > 0):
        message = f"KV transfers complete ({_per_second(transfers)} {window})"
        if fallbacks:
            message += f"; fell back to colocated: {_by_reason(fallbacks)}"
        if failures:
            message += f"; failed hand-offs: {_by_reason(failures)}"
        return Verdict("True", "Disaggregating", message)
    if failures:
        return Verdict(
            "False",
            "TransfersFailing",
            f"every KV hand-off failed {window}: {_by_reason(failures)}",
        )
    if fallbacks:
        message = f"every disaggregated request fell back to colocated {window}: "
        return Verdict("False", "AllFallingBack", message + _by_reason(fallbacks))
    return Verdict(
        "False", "NoDisaggregatedCompletions",
        f"disaggregated requests arrived {window} and none completed a KV transfer",
    )  # fmt: skip
