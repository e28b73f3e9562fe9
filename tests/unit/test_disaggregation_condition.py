"""The DisaggregationActive condition from a window's rates (disaggregation.py)."""

from __future__ import annotations

import pytest

from pdserve.operator.scaling.disaggregation import Signals, verdict

HEALTHY = Signals(routed=2.0, served=2.0, transfers=2.0, prefill_available=2)


def test_true_while_transfers_complete() -> None:
    result = verdict(HEALTHY, 60)
    assert (result.status, result.reason) == ("True", "Disaggregating")
    assert "2/s in the last 60s" in result.message


def test_true_names_the_share_that_fell_back() -> None:
    signals = Signals(
        routed=2.0, served=1.0, transfers=1.0, fallbacks={"handoff_failed": 1.0},
        failures={"transfer_failed": 1.0}, prefill_available=1,
    )  # fmt: skip
    result = verdict(signals, 60)
    assert result.status == "True"
    assert "fell back to colocated: handoff_failed 1/s" in result.message
    assert "failed hand-offs: transfer_failed 1/s" in result.message


@pytest.mark.parametrize(
    ("signals", "reason", "words"),
    [
        (Signals(routed=2.0, fallbacks={"no_prefill": 2.0}, prefill_available=0),
         "NoPrefillWorkerReady", "no prefill worker is ready"),
        (Signals(routed=2.0, served=0.0, transfers=0.0, prefill_available=1,
                 failures={"transfer_failed": 2.0}, fallbacks={"handoff_failed": 2.0}),
         "TransfersFailing", "every KV hand-off failed"),
        (Signals(routed=2.0, served=0.0, transfers=0.0, prefill_available=1,
                 fallbacks={"no_prefill": 2.0}),
         "AllFallingBack", "fell back to colocated in the last 60s: no_prefill 2/s"),
        (Signals(routed=2.0, served=0.0, transfers=0.0, prefill_available=1),
         "NoDisaggregatedCompletions", "none completed a KV transfer"),
        # The transfers of a pool of colocated answers do not make it disaggregated.
        (Signals(routed=2.0, served=0.0, transfers=1.0, prefill_available=1,
                 fallbacks={"handoff_failed": 2.0}),
         "AllFallingBack", "handoff_failed"),
    ],
)  # fmt: skip
def test_false_with_the_reason(signals: Signals, reason: str, words: str) -> None:
    result = verdict(signals, 60)
    assert (result.status, result.reason) == ("False", reason)
    assert words in result.message


def test_unknown_without_disaggregated_traffic() -> None:
    result = verdict(Signals(routed=0.0, served=0.0, transfers=0.0, prefill_available=2), 30)
    assert (result.status, result.reason) == ("Unknown", "NoDisaggregatedTraffic")
    assert "in the last 30s" in result.message


def test_without_a_router_the_workers_transfers_tell() -> None:
    assert verdict(Signals(transfers=1.0, prefill_available=1), 60).status == "True"
    failing = verdict(Signals(transfers=0.0, failures={"timeout": 1.0}, prefill_available=1), 60)
    assert failing.reason == "TransfersFailing"
    idle = verdict(Signals(transfers=0.0, prefill_available=1), 60)
    assert idle.reason == "NoDisaggregatedTraffic"
