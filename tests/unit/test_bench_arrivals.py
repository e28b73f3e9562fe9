"""Arrival processes: the asked-for mean rate and burstiness, reproducible by seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.workers.bench.arrivals import ArrivalProcess, arrival_offsets


def gaps_of(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


@pytest.mark.parametrize(
    ("process", "burstiness"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 1.0), ("gamma", 3.0)]
)
def test_mean_rate_and_cv(process: ArrivalProcess, burstiness: float) -> None:
    rate = 4.0
    offsets = arrival_offsets(np.random.default_rng(7), rate, process, burstiness, count=20_000)
    gaps = gaps_of(offsets)
    assert offsets[0] == 0.0
    assert 1.0 / gaps.mean() == pytest.approx(rate, rel=0.05)
    # Bursty gamma has a heavy spread: the sample CV converges slowly.
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness, rel=0.1)


def test_horizon_bounds_the_arrivals() -> None:
    offsets = arrival_offsets(np.random.default_rng(1), 10.0, horizon_s=30.0)
    assert max(offsets) < 30.0
    assert len(offsets) == pytest.approx(300, rel=0.2)
    assert offsets == sorted(offsets)


def test_count_and_horizon_whichever_first() -> None:
    few = arrival_offsets(np.random.default_rng(1), 10.0, count=5, horizon_s=1000.0)
    assert len(few) == 5


def test_same_seed_same_arrivals() -> None:
    first = arrival_offsets(np.random.default_rng(3), 2.0, "gamma", 2.0, count=50)
    again = arrival_offsets(np.random.default_rng(3), 2.0, "gamma", 2.0, count=50)
    other = arrival_offsets(np.random.default_rng(4), 2.0, "gamma", 2.0, count=50)
    assert first == again
    assert first != other


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(np.random.default_rng(0), math.inf, count=3) == [0.0, 0.0, 0.0]


def test_unbounded_or_bad_parameters_are_refused() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="count or a horizon"):
        arrival_offsets(rng, 1.0)
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(rng, 0.0, count=1)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(rng, 1.0, "gamma", 0.0, count=1)
