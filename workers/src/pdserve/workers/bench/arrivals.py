"""Arrival processes: when each request is sent, as offsets from the start.

Poisson arrivals have exponential gaps (coefficient of variation 1). Gamma arrivals
keep the same mean rate with a chosen CV of the gaps ("burstiness"): CV > 1 sends
bursts separated by lulls, CV < 1 is more regular than Poisson. Gamma with shape
k = 1/CV^2 and scale 1/(rate*k) has mean 1/rate and CV exactly as asked.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

ArrivalProcess = Literal["poisson", "gamma"]
ARRIVAL_PROCESSES: tuple[ArrivalProcess, ...] = ("poisson", "gamma")

# Gaps are drawn in blocks: one numpy call per block, not one per request.
_BLOCK = 1024


def arrival_offsets(
    rng: np.random.Generator,
    rate: float,
    process: ArrivalProcess = "poisson",
    burstiness: float = 1.0,
    count: int | None = None,
    horizon_s: float | None = None,
) -> list[float]:
    """Arrival offsets in seconds, the first at 0, ending at `count` or before `horizon_s`.

    `rate` is in requests per second; `math.inf` sends everything at once (then
    `count` is required). At least one bound must be given.
    """
    if count is None and horizon_s is None:
        raise ValueError("an arrival sequence needs a count or a horizon")
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        if count is None:
            raise ValueError("an infinite rate needs a request count")
        return [0.0] * count
    offsets: list[float] = []
    now = 0.0
    while True:
        for gap in _gaps(rng, rate, process, burstiness):
            if (count is not None and len(offsets) >= count) or (
                horizon_s is not None and now >= horizon_s
            ):
                return offsets
            offsets.append(now)
            now += gap


def _gaps(
    rng: np.random.Generator, rate: float, process: ArrivalProcess, burstiness: float
) -> list[float]:
    """One block of inter-arrival gaps."""
    if process == "poisson":
        return [float(x) for x in rng.exponential(1.0 / rate, _BLOCK)]
    if process == "gamma":
        shape = 1.0 / (burstiness * burstiness)
        return [float(x) for x in rng.gamma(shape, 1.0 / (rate * shape), _BLOCK)]
    raise ValueError(f"unknown arrival process {process!r}")
