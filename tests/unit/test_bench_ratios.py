"""The benchmarks' ratio of two medians with its resampled interval (support.ratios)."""

from __future__ import annotations

from support.ratios import paired_median_ratio


def test_a_candidate_twice_as_fast_on_every_request_is_2x_with_no_spread() -> None:
    baseline = {i: 10.0 + i for i in range(60)}
    candidate = {i: value / 2 for i, value in baseline.items()}
    found = paired_median_ratio(baseline, candidate)
    assert found is not None
    assert found.ratio == found.low == found.high == 2.0
    assert found.requests == 60


def test_a_median_on_the_gap_between_two_bands_gets_a_wide_interval() -> None:
    # The baseline's requests: just under half fast, the rest 10x slower, so its median
    # sits where a few requests changing sides move it across the gap; the candidate's
    # median sits inside its fast band.
    baseline = {i: 100.0 if i < 29 else 1000.0 for i in range(60)}
    candidate = {i: 100.0 if i < 40 else 1000.0 for i in range(60)}
    found = paired_median_ratio(baseline, candidate)
    assert found is not None
    assert found.ratio == 10.0
    assert found.low <= 1.0 and found.high == 10.0  # the run alone does not resolve it
    assert "90% of resamplings 1.00-10.00x, 60 requests" in found.describe()


def test_only_the_requests_both_sides_served_count() -> None:
    baseline = {0: 10.0, 1: 20.0, 2: 30.0, 3: 1e9}
    candidate = {0: 5.0, 1: 10.0, 2: 15.0}
    found = paired_median_ratio(baseline, candidate)
    assert found is not None
    assert (found.ratio, found.requests) == (2.0, 3)


def test_no_shared_request_or_no_positive_median_gives_none() -> None:
    assert paired_median_ratio({0: 1.0}, {1: 1.0}) is None
    assert paired_median_ratio({0: 1.0, 1: 2.0}, {0: 0.0, 1: 0.0}) is None


def test_the_same_seed_gives_the_same_interval() -> None:
    baseline = {i: float(i % 7 + 1) for i in range(40)}
    candidate = {i: float(i % 5 + 1) for i in range(40)}
    assert paired_median_ratio(baseline, candidate) == paired_median_ratio(baseline, candidate)
