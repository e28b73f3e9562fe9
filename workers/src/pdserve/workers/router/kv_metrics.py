"""The router's metrics of KV-aware routing, in the router's registry: what each
decision predicted (prompt tokens, of which cached on the chosen worker), why it
chose (cache, load, or no worker held anything), the P/D decision on uncached
tokens, the index's size, resyncs and handshake failures."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.workers.router.tallies import CounterChild, PlainCounter

ROLE = "router"


class KVRoutingMetrics:
    """The KV-aware routing metrics of one router."""

    def __init__(self, pool: str, registry: CollectorRegistry) -> None:
        self.pool = pool
        base = ("pool", "role", "target")
        reg = registry
        self.prompt_tokens = PlainCounter(
            "pdserve_router_kv_prompt_tokens_total",
            "Prompt tokens of the requests routed to workers of a role (target).",
            base, reg,
        )  # fmt: skip
        self.predicted_hits = PlainCounter(
            "pdserve_router_kv_predicted_hit_tokens_total",
            "Of those, the tokens the router's index said the chosen worker held cached "
            "(the predicted hit rate: this over the prompt tokens; the workers' own "
            "pdserve_prefix_cache_hits_total is the actual).",
            base, reg,
        )  # fmt: skip
        self.actual_hits = PlainCounter(
            "pdserve_router_kv_actual_hit_tokens_total",
            "Of the prompt tokens routed, those the serving worker's engine found cached, "
            "as its answer says (the actual hit rate of the router's decisions; against "
            "pdserve_router_kv_predicted_hit_tokens_total: the index's accuracy).",
            base, reg,
        )  # fmt: skip
        self.predictions = PlainCounter(
            "pdserve_router_kv_predictions_total",
            "Decisions by how the cached tokens the index predicted compare with the "
            "engine's count for that request: exact, over (predicted more), under, or "
            "unknown (the answer did not say).",
            (*base, "result"), reg,
        )  # fmt: skip
        self.decisions = PlainCounter(
            "pdserve_router_kv_decisions_total",
            "KV-aware choices of a worker, by reason: cache (the chosen worker holds the "
            "longest cached prefix), load (a worker holding more was passed over for "
            "load), none (no worker holds any of the prompt).",
            (*base, "reason"), reg,
        )  # fmt: skip
        self.pd_decisions = PlainCounter(
            "pdserve_router_kv_pd_decisions_total",
            "Requests whose mode was decided on the tokens the chosen decode worker "
            "lacks, by the mode their length alone gave (by_length) and the mode taken.",
            ("pool", "role", "by_length", "mode"), reg,
        )  # fmt: skip
        self.index_blocks = Gauge(
            "pdserve_router_kv_index_blocks",
            "(block, worker) pairs in the router's KV index, by role (target).",
            base, registry=reg,
        )  # fmt: skip
        self.index_bytes = Gauge(
            "pdserve_router_kv_index_bytes",
            "Memory the router's KV index of a role (target) holds.",
            base, registry=reg,
        )  # fmt: skip
        self.resyncs = Counter(
            "pdserve_router_kv_resyncs_total",
            "Reads of a worker's whole KV index (snapshot), by reason: start, gap (events "
            "missed), epoch (the worker restarted), reconnect, overflow (more blocks than "
            "its cache holds).",
            (*base, "reason"), registry=reg,
        )  # fmt: skip
        self.handshake_failures = Counter(
            "pdserve_router_kv_handshake_failures_total",
            "Workers refused for KV-aware scoring, by what differed (block_size, "
            "hash_function, hash_seed, model, weights) or feed (unusable answers).",
            (*base, "reason"), registry=reg,
        )  # fmt: skip
        self.workers = Gauge(
            "pdserve_router_kv_workers",
            "Workers by the state of their KV feed: synced, syncing, refused, unreachable.",
            (*base, "state"), registry=reg,
        )  # fmt: skip
        # Children of the per-request counters (plain numbers, see `tallies`), bound as
        # each label set is first seen.
        self._chosen: dict[tuple[str, str], tuple[CounterChild, ...]] = {}
        self._modes: dict[tuple[str, str], CounterChild] = {}
        self._bound: dict[tuple[object, ...], CounterChild] = {}

    def _labels(self, target: str, **extra: str) -> dict[str, str]:
        return {"pool": self.pool, "role": ROLE, "target": target, **extra}

    def chose(self, target: str, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A worker of `target` role chosen for a prompt, `cached_tokens` predicted."""
        children = self._chosen.get((target, reason))
        if children is None:  # labels bound once: this runs for every request
            labels = self._labels(target)
            children = (
                self.prompt_tokens.labels(**labels),
                self.predicted_hits.labels(**labels),
                self.decisions.labels(**labels, reason=reason),
            )
            self._chosen[(target, reason)] = children
        prompt, hits, decisions = children
        prompt.inc(prompt_tokens)
        hits.inc(cached_tokens)
        decisions.inc()

    def observed(self, target: str, predicted: int, actual: int | None) -> None:
        """A worker of `target` role found `actual` cached tokens (None: unknown) where
        `predicted` were."""
        if actual is None:
            result = "unknown"
        else:
            self._child(self.actual_hits, target, "").inc(actual)
            result = "exact" if actual == predicted else "over" if predicted > actual else "under"
        self._child(self.predictions, target, result).inc()

    def _child(self, counter: PlainCounter, target: str, result: str) -> CounterChild:
        """The child of a per-request counter, bound once (a label lookup per request
        costs more than the count); `result`: its result label ("": none)."""
        key = (counter, target, result)
        child = self._bound.get(key)
        if child is None:
            labels = self._labels(target, result=result) if result else self._labels(target)
            child = self._bound[key] = counter.labels(**labels)
        return child

    def decided_mode(self, by_length: str, mode: str) -> None:
        """The P/D decision on uncached tokens."""
        counter = self._modes.get((by_length, mode))
        if counter is None:
            labels = {"pool": self.pool, "role": ROLE, "by_length": by_length, "mode": mode}
            counter = self._modes[(by_length, mode)] = self.pd_decisions.labels(**labels)
        counter.inc()

    def resynced(self, target: str, reason: str) -> None:
        """A worker's index read whole again."""
        self.resyncs.labels(**self._labels(target, reason=reason)).inc()

    def refused(self, target: str, reason: str) -> None:
        """A worker refused for KV scoring."""
        self.handshake_failures.labels(**self._labels(target, reason=reason)).inc()

    def set_index(self, target: str, blocks: int, memory_bytes: int) -> None:
        """The size of a role's index."""
        self.index_blocks.labels(**self._labels(target)).set(blocks)
        self.index_bytes.labels(**self._labels(target)).set(memory_bytes)

    def set_states(self, target: str, counts: dict[str, int]) -> None:
        """Workers of a role by their feed's state."""
        for state in ("synced", "syncing", "refused", "unreachable"):
            self.workers.labels(**self._labels(target, state=state)).set(counts.get(state, 0))
