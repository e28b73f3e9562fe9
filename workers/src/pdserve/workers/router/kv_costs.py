"""A worker's predicted time to first token for a request, from what its steps cost.

Every worker publishes at /load what its engine's step-cost model has learned from
its own steps (`step_costs`: seconds per prompt token computed, per cached token a
prompt token's attention reads, per decoding request, a step's fixed cost, and its
token budget per step). A request sent to a worker waits for the prompt tokens queued
before it and its own uncached tokens to be computed, in steps of at most the token
budget, and every one of those steps also carries the requests the worker is
decoding:

    steps = ceil((queued + uncached) / step tokens)
    TTFT  = (queued + uncached) x prefill token s + own keys x prefill key s
            + steps x (step base s + requests held x decode s per request)
            + what waiting for a seat or blocks adds beyond the queue's own time

where own keys are the cached tokens the request's uncached tokens attend to
(uncached x (cached + uncached / 2)). A request that must wait for a seat in the
running batch or for KV blocks (`kv_room`) waits that many steps at the same step
cost; the prompts queued before it are computed meanwhile, so only what the wait
lasts beyond their time is added. The figures are the worker's own measurements,
so a slower device, a busier machine or a larger model weighs load against cache
hits as it really costs there. Until a worker has published (its model warms up over
its first steps), it is taken to cost what the other candidates publish, or
`DEFAULT_COSTS` when none has: the order of magnitude of a small model on a CPU,
replaced as soon as the workers have run a few steps.

A worker's prefill costs are learned from the prompts it computed, and a worker that
computed few lately has learned them from little: from a few short prompts, or from
steps a burst of other work slowed, it can learn a prompt token two or three times
dearer than its peers of the same model and resources do, and a dearer worker gets
no new prompts to learn better from. So each worker publishes the prompt tokens it
learned them from (counted as the fit counts them, recent ones more), and its prefill
costs are taken as its own and its peers' weighed by those tokens
(`drawn_to_peers`): a worker's own figures outweigh the pool's once it has learned
them from more than `PEER_PREFILL_TOKENS`.

What a worker publishes is a peer's word: anything missing, negative, not finite or
out of bounds leaves that worker with no published costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

# A step's figures above these are not believed (seconds per step, tokens per step).
_MAX_SECONDS = 3600.0
_MAX_STEP_TOKENS = 1 << 24
_MAX_LEARNED_TOKENS = 1 << 48

# A worker's own prefill costs outweigh its peers' once it has learned them from more
# prompt tokens than this (16 chunks of 512): the workers of a pool run the same model
# on the same resources, so until then a gap between its figures and theirs is more
# likely what a few prompts could not tell apart than a slower worker.
PEER_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class StepCosts:
    """What a worker's steps cost, in seconds (its `/load`'s `step_costs`)."""

    base_s: float
    prefill_token_s: float
    prefill_key_s: float
    decode_token_s: float
    decode_s: float = 0.0  # its last step's decodes
    decodes: int = 0  # requests decoding in its last step
    step_tokens: int = 512
    # Prompt tokens it learned the prefill costs from (recent ones counting more; an
    # older worker that does not say: 0, its peers' figures taken where they have any).
    prefill_tokens: int = 0

    @property
    def per_request_decode_s(self) -> float:
        """What one decoding request adds to a step: measured on its last step's
        decodes (their keys included) when it had some, else the model's per-token
        cost."""
        return self.decode_s / self.decodes if self.decodes > 0 else self.decode_token_s

    @classmethod
    def of(cls, body: Any) -> StepCosts | None:
        """From `/load`'s `step_costs` object; None when absent or not believable."""
        if not isinstance(body, dict):
            return None
        try:
            seconds = {
                name: _seconds(body[name])
                for name in ("base_s", "prefill_token_s", "prefill_key_s", "decode_token_s",
                             "decode_s")
            }  # fmt: skip
            decodes, step_tokens = _count(body["decodes"]), _count(body["step_tokens"])
            learned = _count(body.get("prefill_tokens", 0), _MAX_LEARNED_TOKENS)
        except (KeyError, ValueError):
            return None
        if step_tokens < 1:
            return None
        return cls(**seconds, decodes=decodes, step_tokens=step_tokens, prefill_tokens=learned)

    def step_s(self, requests: int) -> float:
        """A step's cost besides its prompt tokens, while `requests` others decode."""
        return self.base_s + max(0, requests) * self.per_request_decode_s

    def ttft_s(
        self, queued: int, uncached: int, cached: int, requests: int, wait_steps: float = 0.0
    ) -> float:
        """Predicted seconds to the first token of a request whose `uncached` prompt
        tokens are computed after `queued` others, past `cached` tokens found in the
        cache, while `requests` others decode, once it has waited `wait_steps` steps
        for a seat or blocks."""
        queued, uncached = max(0, queued), max(0, uncached)
        work = queued + uncached
        steps = max(1, math.ceil(work / self.step_tokens))
        keys = uncached * (cached + uncached / 2)
        step_s = self.step_s(requests)
        compute_s = work * self.prefill_token_s + keys * self.prefill_key_s + steps * step_s
        queue_s = queued * self.prefill_token_s + queued / self.step_tokens * step_s
        return compute_s + max(0.0, wait_steps * step_s - queue_s)


# Before any worker has published: a small model on a CPU (0.5 ms a prompt token,
# 1 ms a decoding request, 10 ms a step). Only the ratios matter while every
# candidate uses them, and they go as soon as the workers have published.
DEFAULT_COSTS = StepCosts(base_s=0.01, prefill_token_s=5e-4, prefill_key_s=0.0, decode_token_s=1e-3)


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("not a number")
    number = float(value)
    if not math.isfinite(number) or not 0.0 <= number <= _MAX_SECONDS:
        raise ValueError("out of bounds")
    return number


def _count(value: Any, most: int = _MAX_STEP_TOKENS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError("not a count")
    return value


def pool_costs(published: list[StepCosts]) -> StepCosts:
    """The costs taken for a worker that has not published: the median (by prompt
    token cost) of those its peers published, else the defaults."""
    if not published:
        return DEFAULT_COSTS
    return sorted(published, key=lambda costs: costs.prefill_token_s)[len(published) // 2]


def drawn_to_peers(published: Mapping[str, StepCosts]) -> dict[str, StepCosts]:
    """Each worker's published costs with its prefill terms (per prompt token, per key
    read) drawn toward the pool's: the mean of every worker's, weighed by the prompt
    tokens each learned them from. A worker that learned them from t tokens keeps
    t / (t + PEER_PREFILL_TOKENS) of its own figures."""
    learned = sum(costs.prefill_tokens for costs in published.values())
    if learned <= 0:
        return dict(published)

    def pooled(term: Callable[[StepCosts], float]) -> float:
        return sum(c.prefill_tokens * term(c) for c in published.values()) / learned

    token_s = pooled(lambda costs: costs.prefill_token_s)
    key_s = pooled(lambda costs: costs.prefill_key_s)

    def drawn(costs: StepCosts) -> StepCosts:
        own = costs.prefill_tokens / (costs.prefill_tokens + PEER_PREFILL_TOKENS)
        return replace(
            costs,
            prefill_token_s=own * costs.prefill_token_s + (1 - own) * token_s,
            prefill_key_s=own * costs.prefill_key_s + (1 - own) * key_s,
        )

    return {url: drawn(costs) for url, costs in published.items()}


def priced_costs(published: Mapping[str, StepCosts | None]) -> dict[str, StepCosts]:
    """The costs each candidate is priced at: what it published, drawn toward its
    peers' (`drawn_to_peers`), or, where it published none, its peers' (`pool_costs`)."""
    known = {url: costs for url, costs in published.items() if costs is not None}
    fallback = pool_costs(list(known.values()))
    drawn = drawn_to_peers(known)
    return {url: drawn.get(url, fallback) for url in published}
