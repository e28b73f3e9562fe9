"""Fault injection (pdserve.workers.faults): what a point does, read from the
environment a test gives a worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.workers import faults
from pdserve.workers.faults import Fault


@pytest.fixture
def stalls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The stalls points make (time.sleep recorded instead of slept)."""
    slept: list[float] = []
    monkeypatch.setattr("pdserve.workers.faults.time.sleep", slept.append)
    faults.configured.cache_clear()
    yield slept
    faults.configured.cache_clear()


def configure(monkeypatch: pytest.MonkeyPatch, spec: dict[str, Fault | list[Fault]]) -> None:
    monkeypatch.setenv(faults.ENV, faults.environment(spec)[faults.ENV])
    faults.configured.cache_clear()


def test_a_step_stalls_longer_the_more_requests_it_carries(
    monkeypatch: pytest.MonkeyPatch, stalls: list[float]
) -> None:
    configure(monkeypatch, {"engine.step": Fault(delay_s=0.01, delay_per_request_s=0.1)})
    for requests in (0, 1, 4):
        faults.blocking_point("engine.step", requests)
    assert stalls == pytest.approx([0.01, 0.11, 0.41])


def test_a_gated_fault_acts_only_while_its_file_exists(
    monkeypatch: pytest.MonkeyPatch, stalls: list[float], tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    configure(monkeypatch, {"engine.step": Fault(delay_per_request_s=0.5, when=str(gate))})
    faults.blocking_point("engine.step", 2)
    gate.touch()
    faults.blocking_point("engine.step", 2)
    assert stalls == [1.0]
