"""The router of a simulated pool: the routing table's buckets, and the worker choice
the table's policy names, by the router's own code: `WorkerSet.choose` by load, or
KV-aware, `KVScorer` over a `KVIndex` per role, the mode decided on the tokens the
chosen decode worker lacks.

Each simulated engine reports its prefix cache to a real `KVEventLog`, as a worker
does; the router's index takes the events a step produced when the step ends (a
real router reads them from the worker's feed a moment after the worker publishes
them). A worker whose block size is not the table's is refused, as the feed's
handshake refuses it: it holds nothing in the index and competes on load alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdserve.protocol.routing import ROLES, Mode, Role, RoutingTable
from pdserve.workers.engine.engine import LLMEngine
from pdserve.workers.engine.kv_events import KVEventLog
from pdserve.workers.router.kv_index import BlockKey, KVIndex, block_key
from pdserve.workers.router.kv_metrics import KVRoutingMetrics
from pdserve.workers.router.kv_scoring import KVPrompt, KVScorer
from pdserve.workers.router.workers import Worker, WorkerSet


@dataclass(frozen=True)
class Route:
    """Where the router sends a request, and what it expected there."""

    mode: Mode
    decode: Worker
    prefill: Worker | None
    cached_tokens: int  # prompt tokens the router's index said the decode worker holds
    reason: str  # the KV decision for the decode worker: cache, load, none ("" by load)
    prefill_cached: int = 0  # and the prefill worker, disaggregated
    keys: tuple[BlockKey, ...] = ()  # the prompt's block keys (KV-aware)

    @property
    def prefills(self) -> Worker:
        """The worker that computes the prompt: the prefill worker, else the decode
        worker (colocated)."""
        return self.decode if self.prefill is None else self.prefill

    def uncached(self, prompt_tokens: int) -> int:
        """The prompt tokens the worker that computes it does not hold, by the index:
        what the router counts as waiting there until the first token
        (`Outstanding`)."""
        held = self.cached_tokens if self.prefill is None else self.prefill_cached
        return prompt_tokens - held


class KVFeed:
    """One worker's prefix-cache events, mirrored into its role's index."""

    def __init__(self, url: str, index: KVIndex, engine: LLMEngine) -> None:
        self.url = url
        self.index = index
        self.log = KVEventLog()
        self.seq = 0
        engine.kv_cache.pool.prefix_watcher = self.log
        index.replace(url, (), engine.num_blocks)

    def sync(self) -> None:
        """Apply the events since the last sync (a folded event may carry numbers
        already applied: only the newer of its hashes count)."""
        since = self.log.since(self.log.epoch, self.seq)
        for event in since.events:
            fresh = event.hashes[len(event.hashes) - (event.seq - self.seq) :]
            self.index.apply(self.url, event.kind, [block_key(h) for h in fresh])
            self.seq = event.seq


class SimRouter:
    """The router's choices over the simulated workers' published loads."""

    def __init__(
        self, table: RoutingTable, sets: Mapping[Role, WorkerSet], clock: Callable[[], float]
    ) -> None:
        self.table = table
        self.sets = sets
        self.indexes: dict[Role, KVIndex] = {role: KVIndex() for role in ROLES}
        self.registry = CollectorRegistry()
        self.scorer: KVScorer | None = None
        if table.routing_policy.type == "kv-aware":
            metrics = KVRoutingMetrics(table.pool, self.registry)
            self.scorer = KVScorer(self, metrics, clock)

    def feed(self, role: Role, url: str, engine: LLMEngine) -> KVFeed | None:
        """Follow a worker's prefix cache (None: routing by load, or a worker the
        handshake would refuse)."""
        if self.scorer is None or engine.block_size != self.table.routing_policy.block_size:
            return None
        return KVFeed(url, self.indexes[role], engine)

    def route(self, prompt: Sequence[int]) -> Route | None:
        """The decode worker (and prefill worker, disaggregated) for a prompt; None
        when no decode worker is available."""
        table = self.table
        mode = table.buckets[table.bucket_of(len(prompt))].mode
        kv = None if self.scorer is None else KVPrompt.of(prompt, table)
        if self.scorer is None or kv is None:
            decode = self.sets["decode"].choose()
            cached, reason = 0, ""
        else:
            choice = self.scorer.choose(self.sets["decode"], kv)
            decode = None if choice is None else choice.worker
            cached = 0 if choice is None else choice.cached_tokens
            reason = "" if choice is None else choice.reason
            if choice is not None:
                mode = self.scorer.mode(kv, mode, cached)
        if decode is None:
            return None
        prefill, prefill_cached = self._prefill(kv) if mode == "disaggregated" else (None, 0)
        if prefill is None:
            mode = "colocated"  # the router's fallback when no prefill worker is available
        keys = () if kv is None else kv.keys
        return Route(mode, decode, prefill, cached, reason, prefill_cached, keys)

    def _prefill(self, kv: KVPrompt | None) -> tuple[Worker | None, int]:
        if self.scorer is None or kv is None:
            return self.sets["prefill"].choose(), 0
        choice = self.scorer.choose(self.sets["prefill"], kv)
        return (None, 0) if choice is None else (choice.worker, choice.cached_tokens)
