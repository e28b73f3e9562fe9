"""KV-aware choice of a worker, and the P/D decision on uncached tokens.

A worker's expected work for a request is the prompt tokens it would compute (those
not in its prefix cache, from the router's index; at least one, the step that
samples) plus its load in tokens: the prompt tokens waiting to be prefilled in it
(the router's own count of what it sent, and what the worker published beyond it)
and `loadWeightTokens` per request it holds. The cheapest worker wins; ties
go to the less loaded, then to chance. A decode worker whose KV cache is nearly full
is passed over while another is not, as by load alone. A worker whose feed is not
synced (starting, refused by the handshake, unreachable) holds nothing in the index:
it competes on load alone.

The mode follows the decode worker: the routing table's bucket is looked up with
the tokens the chosen decode worker would still compute, so a long conversation
whose history that worker holds is served colocated.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.protocol.routing import Mode, Role, RoutingTable
from pdserve.workers.engine.kv_events import prefix_hashes
from pdserve.workers.router.kv_index import BlockKey, KVIndex, block_key
from pdserve.workers.router.kv_metrics import KVRoutingMetrics
from pdserve.workers.router.workers import KV_NEARLY_FULL, Worker, WorkerSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVPrompt:
    """What KV-aware routing needs of a request: its blocks' keys and the table."""

    keys: tuple[BlockKey, ...]
    tokens: int
    table: RoutingTable

    @classmethod
    def of(cls, token_ids: Sequence[int], table: RoutingTable) -> KVPrompt | None:
        """The prompt's blocks as the workers hash them; None when the table routes by
        load only."""
        policy = table.routing_policy
        if policy.type != "kv-aware":
            return None
        hashes = prefix_hashes(token_ids, policy.block_size, policy.hash_seed)
        return cls(tuple(block_key(h) for h in hashes), len(token_ids), table)


class KVIndexes(Protocol):
    """Where the index of each role is kept: the router's feeds (`KVFeeds`), or a
    simulated pool's router."""

    @property
    def indexes(self) -> Mapping[Role, KVIndex]:
        """The index of each role."""
        ...


@dataclass(frozen=True)
class KVChoice:
    """A worker chosen, the prompt tokens it holds, and why it was chosen."""

    worker: Worker
    cached_tokens: int
    reason: str  # cache, load or none (see KVRoutingMetrics.decisions)


class KVScorer:
    """Chooses workers by expected work."""

    def __init__(
        self,
        feeds: KVIndexes,
        metrics: KVRoutingMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.feeds = feeds
        self.metrics = metrics
        self._clock = clock

    def choose(
        self, workers: WorkerSet, prompt: KVPrompt, exclude: Collection[str] = ()
    ) -> KVChoice | None:
        """The cheapest available worker of `workers` not in `exclude` (counted)."""
        candidates = [w for w in workers.available() if w.url not in exclude]
        if not candidates:
            return None
        policy = prompt.table.routing_policy
        held = self.feeds.indexes[workers.role].cached_blocks(prompt.keys)
        now = self._clock()
        # The engine leaves a prompt's last token to compute (the step that computes
        # it samples): at most the full blocks before it are found.
        usable = (prompt.tokens - 1) // policy.block_size
        cached = {w.url: min(held.get(w.url, 0), usable) * policy.block_size for w in candidates}
        if len(candidates) == 1:  # nothing to weigh
            best = candidates[0]
        else:
            best = min(candidates, key=lambda w: self._cost(w, prompt, cached[w.url], now))
        most = max(cached.values())
        reason = "none" if most <= 0 else "cache" if cached[best.url] == most else "load"
        self.metrics.chose(workers.role, reason, prompt.tokens, cached[best.url])
        return KVChoice(best, cached[best.url], reason)

    def _cost(self, worker: Worker, prompt: KVPrompt, cached: int, now: float) -> tuple[float, ...]:
        weight = prompt.table.routing_policy.load_weight_tokens
        requests = worker.requests(now)
        uncached = prompt.tokens - cached
        # The last keys break ties: the less loaded, then chance (equal workers share
        # the traffic).
        if worker.role == "prefill":
            waiting = worker.waiting_prefill_tokens(now)
            return (uncached + waiting + weight * requests, waiting, requests, random.random())
        # A decode worker prefills colocated requests itself: their backlog is work too.
        waiting = worker.waiting_prefill_tokens(now)
        usage = worker.kv_cache_usage(now)
        full = float(usage >= KV_NEARLY_FULL)
        work = uncached + waiting + weight * requests
        return (full, work, requests, usage, random.random())

    def observed(
        self, request_id: str, prompt: KVPrompt, predicted: int, found: str | None
    ) -> None:
        """The decode worker's answer says its engine found `found` prompt tokens cached
        (its X-Pdserve-Cached-Tokens header; None or unusable: unknown), where the
        index predicted `predicted`: counted, and logged when they differ."""
        actual = _cached_count(found, prompt.tokens)
        self.metrics.observed("decode", predicted, actual)
        if actual != predicted:
            log.debug(
                "request %s: the index predicted %d cached prompt tokens, the engine found %s",
                request_id, predicted, "an unknown number" if actual is None else actual,
            )  # fmt: skip

    def mode(self, prompt: KVPrompt, by_length: Mode, cached_tokens: int) -> Mode:
        """The mode of a request whose chosen decode worker holds `cached_tokens`
        (counted against the mode its length alone gave)."""
        table = prompt.table
        mode = table.buckets[table.bucket_of(prompt.tokens - cached_tokens)].mode
        self.metrics.decided_mode(by_length, mode)
        return mode


def _cached_count(header: str | None, prompt_tokens: int) -> int | None:
    """A worker's count of cached prompt tokens, if it is one (a peer's word: a whole
    number within the prompt)."""
    if header is None or not header.isascii() or not header.isdigit():
        return None
    count = int(header)
    return count if count <= prompt_tokens else None
