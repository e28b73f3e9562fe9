"""How far one run's ratio of two medians can be trusted.

Two routers (or two settings) that serve the same replay give, request by request, two
latencies of the same request. Their medians' ratio is the figure a benchmark reports,
but on a replay whose latencies fall in two bands (hits and tiny prompts fast, long
misses slow) a median near the gap between the bands moves a long way when a few
requests change sides, so one run's ratio can be far from the next one's. Drawing the
run's requests again with replacement, the same requests for both sides (a paired
bootstrap), and taking the ratio each time shows that spread from the run alone: an
interval that reaches 1 says the run did not tell the two apart."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

DRAWS = 2000
LEVEL = 0.9


@dataclass(frozen=True)
class MedianRatio:
    """The baseline's median over the candidate's, on the requests both served, and
    the central `level` share of that ratio over the resamplings."""

    ratio: float
    low: float
    high: float
    requests: int
    level: float

    def describe(self) -> str:
        """`2.05x (90% of resamplings 1.12-2.81x, 90 requests)`."""
        share = f"{self.level * 100:.0f}%"
        spread = f"{share} of resamplings {self.low:.2f}-{self.high:.2f}x"
        return f"{self.ratio:.2f}x ({spread}, {self.requests} requests)"


def paired_median_ratio(
    baseline: Mapping[int, float],
    candidate: Mapping[int, float],
    draws: int = DRAWS,
    level: float = LEVEL,
    seed: int = 0,
) -> MedianRatio | None:
    """The median of `baseline` over that of `candidate` (each a value per request,
    by request index), on the requests both have, with its resampled interval. None
    where they share no request or a median is not positive."""
    shared = sorted(baseline.keys() & candidate.keys())
    if not shared:
        return None
    base = np.array([baseline[index] for index in shared], dtype=float)
    cand = np.array([candidate[index] for index in shared], dtype=float)
    ratio = _ratio(base, cand)
    if ratio is None:
        return None
    picks = np.random.default_rng(seed).integers(0, len(shared), size=(draws, len(shared)))
    medians = np.median(base[picks], axis=1), np.median(cand[picks], axis=1)
    valid = medians[1] > 0
    ratios = medians[0][valid] / medians[1][valid]
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail]) if len(ratios) else (ratio, ratio)
    return MedianRatio(ratio, float(low), float(high), len(shared), level)


def _ratio(base: np.ndarray, cand: np.ndarray) -> float | None:
    top, bottom = float(np.median(base)), float(np.median(cand))
    return top / bottom if top > 0 and bottom > 0 else None
