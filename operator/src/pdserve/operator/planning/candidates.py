"""The pools a plan tries: variations of the user's ServingPool, each validated as
the API validates a manifest.

Three families: colocated (no prefill pool; the decode workers' token budget, static
at a few sizes or adaptive on the ITL target), bucketed (prompts up to a boundary
colocated, longer ones disaggregated) and disaggregated (every prompt through a
prefill worker). Worker counts stay within the pool's replica bounds
(spec.autoscaling.{prefill,decode}) and its prefill:decode ratio bound, if any.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.operator import api

Family = Literal["colocated", "bucketed", "disaggregated"]
FAMILIES: tuple[Family, ...] = ("colocated", "bucketed", "disaggregated")
# Static token budgets tried for colocated pools, beside the pool's own.
STATIC_BUDGETS = (256, 512, 1024, 2048)
# Boundaries tried for bucketed pools, beside the pool's own.
BOUNDARIES = (256, 512, 1024, 2048)


@dataclass(frozen=True)
class Candidate:
    """One pool to simulate."""

    family: Family
    prefill: int
    decode: int
    budget: str  # the decode workers' token budget, in words
    boundary: int | None  # bucketed: the longest prompt served colocated
    spec: api.ServingPoolSpec

    @property
    def workers(self) -> int:
        """Workers of both roles."""
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        """A short name for tables: family, split, budget, boundary."""
        split = f"{self.prefill}P+{self.decode}D" if self.prefill else f"{self.decode}D"
        edge = f" <={self.boundary} colocated" if self.boundary is not None else ""
        return f"{self.family} {split} budget {self.budget}{edge}"


@dataclass(frozen=True)
class Bounds:
    """Worker counts a plan may choose."""

    prefill: tuple[int, int]
    decode: tuple[int, int]
    ratio: tuple[float | None, float | None]

    @classmethod
    def of(cls, spec: api.ServingPoolSpec, max_workers: int | None) -> Bounds:
        """The pool's replica bounds (at least one decode worker and one prefill worker
        where one is used), capped by `max_workers`."""
        scaling = spec.autoscaling
        cap = max_workers or 10**6
        prefill = (max(1, scaling.prefill.min_replicas), min(cap, scaling.prefill.max_replicas))
        decode = (max(1, scaling.decode.min_replicas), min(cap, scaling.decode.max_replicas))
        bound = scaling.policy.prefill_decode_ratio
        ratio = (None, None) if bound is None else (bound.min, bound.max)
        return cls(prefill, decode, ratio)

    def splits(self, total: int) -> Iterator[tuple[int, int]]:
        """(prefill, decode) pairs of `total` workers within the bounds."""
        for prefill in range(self.prefill[0], self.prefill[1] + 1):
            decode = total - prefill
            low, high = self.ratio
            if not self.decode[0] <= decode <= self.decode[1]:
                continue
            if (low is not None and prefill < low * decode) or (
                high is not None and prefill > high * decode
            ):
                continue
            yield prefill, decode


def candidates(spec: api.ServingPoolSpec, bounds: Bounds, total: int) -> Iterator[Candidate]:
    """Every candidate pool of `total` workers."""
    if bounds.decode[0] <= total <= bounds.decode[1]:
        for budget, engine in _budgets(spec):
            pool = _spec(spec, None, total, engine, [{"mode": "colocated"}])
            yield Candidate("colocated", 0, total, budget, None, pool)
    own = _budget_words(spec.decode.engine)
    for prefill, decode in bounds.splits(total):
        for boundary in _boundaries(spec):
            buckets: list[dict[str, Any]] = [
                {"maxInputTokens": boundary, "mode": "colocated"},
                {"mode": "disaggregated"},
            ]
            pool = _spec(spec, prefill, decode, None, buckets)
            yield Candidate("bucketed", prefill, decode, own, boundary, pool)
        pool = _spec(spec, prefill, decode, None, [{"mode": "disaggregated"}])
        yield Candidate("disaggregated", prefill, decode, own, None, pool)


def smallest_total(bounds: Bounds) -> int:
    """The fewest workers any family can have."""
    return bounds.decode[0]


def largest_total(bounds: Bounds) -> int:
    """The most workers any family can have."""
    return bounds.decode[1] + bounds.prefill[1]


def _budgets(spec: api.ServingPoolSpec) -> Iterator[tuple[str, dict[str, Any]]]:
    """The decode engine settings a colocated pool is tried with."""
    engine = api.dump(spec.decode.engine)
    seats = spec.decode.engine.max_num_seqs
    sizes = sorted({spec.decode.engine.max_num_batched_tokens, *STATIC_BUDGETS})
    for size in (s for s in sizes if s >= seats):
        yield f"static {size}", {**engine, "maxNumBatchedTokens": size, "tokenBudget": {}}
    if spec.slo is not None and spec.slo.itl is not None:
        ceiling = max(sizes)
        adaptive = {"mode": "adaptive", "max": ceiling}
        yield f"adaptive (ITL {spec.slo.itl.seconds * 1000:g} ms)", {
            **engine, "maxNumBatchedTokens": ceiling, "tokenBudget": adaptive,
        }  # fmt: skip


def _budget_words(engine: api.EngineSettings) -> str:
    budget = engine.token_budget
    if budget.mode == "adaptive":
        return f"adaptive (max {budget.max_budget or engine.max_num_batched_tokens})"
    return f"static {engine.max_num_batched_tokens}"


def _boundaries(spec: api.ServingPoolSpec) -> list[int]:
    """Boundaries to try: the pool's own and a few more, all inside the context."""
    own = {b.max_input_tokens for b in spec.routing.buckets if b.max_input_tokens is not None}
    limit = spec.model.max_model_len
    return sorted(b for b in own | set(BOUNDARIES) if limit is None or b < limit)


def _spec(
    spec: api.ServingPoolSpec,
    prefill: int | None,
    decode: int,
    decode_engine: Mapping[str, Any] | None,
    buckets: list[dict[str, Any]],
) -> api.ServingPoolSpec:
    """The pool with these counts, buckets and (if given) decode engine settings."""
    data = api.dump(spec)
    data["decode"] = {**data.get("decode", {}), "replicas": decode}
    if decode_engine is not None:
        data["decode"]["engine"] = dict(decode_engine)
    if prefill is None:
        data.pop("prefill", None)
    else:
        own = data.get("prefill") or {"engine": data["decode"].get("engine", {})}
        data["prefill"] = {**own, "replicas": prefill}
    data["routing"] = {**data.get("routing", {}), "buckets": buckets}
    return api.parse_spec(data)
