"""Prometheus metrics of a worker, fed from the engine's stats objects and from the
server's view of each request. Names follow one scheme across the project: prefix
`pdserve_`, base units, counters ending in `_total`, labels `pool` and `role`
(plus `bucket` on per-request latencies; no request ids)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.protocol.api_errors import APIError
from pdserve.workers.handoff.errors import known_code
from pdserve.workers.metric_labels import LATENCY_BUCKETS, rejection_reason

if TYPE_CHECKING:  # the router shares the names and buckets here, and loads no torch
    from pdserve.workers.engine.engine import StepResult
    from pdserve.workers.engine.step_cost import StepCostEstimate
    from pdserve.workers.kv_transfer.base import TransferStats

# Latency buckets in seconds: fine below 100 ms where ITL lives, coarse up to minutes.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# The step-cost model's terms, each a gauge pdserve_engine_step_cost_<term>_seconds.
STEP_COST_TERMS = {
    "base": "Step-cost model: seconds every step costs.",
    "per_decode_token": "Step-cost model: seconds per decode token.",
    "per_prefill_token": "Step-cost model: seconds per prefill token.",
    "per_decode_key": "Step-cost model: seconds per cached token a decode attends to.",
    "per_prefill_key": "Step-cost model: seconds per (prefill token, cached token) pair.",
    "margin": "Step-cost model: safety margin learned from its prediction errors.",
}
# Input-length buckets (prompt tokens) for per-bucket latencies.
INPUT_LENGTH_BUCKETS = (256, 1024, 4096)


def input_bucket(num_prompt_tokens: int, edges: Sequence[int] = INPUT_LENGTH_BUCKETS) -> str:
    """The label of the input-length bucket a prompt falls in, e.g. `le1024` or `gt4096`."""
    for edge in edges:
        if num_prompt_tokens <= edge:
            return f"le{edge}"
    return f"gt{edges[-1]}"


class WorkerMetrics:
    """All metrics of one worker, in a registry of their own."""

    def __init__(
        self,
        pool: str,
        role: str,
        registry: CollectorRegistry | None = None,
        revision: str = "",
    ) -> None:
        self.registry = registry or CollectorRegistry()
        # The revision (`--revision`) tells a canary's figures from the stable one's.
        self._labels = {"pool": pool, "role": role, "revision": revision}
        names = ("pool", "role", "revision")
        labeled = (*names, "bucket", "mode")
        reg = self.registry
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival to its first token.",
            labeled, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Every gap between consecutive tokens of a request.",
            labeled, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Per request: (end-to-end - TTFT) / (output tokens - 1).",
            labeled, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request arrival to its last token.",
            labeled, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.queue_time = Histogram(
            "pdserve_request_queue_time_seconds",
            "Request arrival to its first scheduled step.",
            names, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.requests = Counter(
            "pdserve_requests_total", "Requests that ended, by finish reason.",
            (*names, "finish_reason"), registry=reg,
        )  # fmt: skip
        self.rejected = Counter(
            "pdserve_requests_rejected_total",
            "Requests answered with an error status, by reason: invalid, not_found, "
            "too_large, queue_full (429), queue_timeout, engine_stopped, handoff_failed, "
            "connection_limit, body_read_limit, body_timeout, internal.",
            (*names, "reason"), registry=reg,
        )  # fmt: skip
        self.aborted = Counter(
            "pdserve_requests_aborted_total",
            "Requests the worker aborted itself, by reason: stream_buffer_full (more than "
            "--max-stream-buffer-tokens tokens waited for a client that did not read them).",
            (*names, "reason"), registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens_total", "Prompt tokens of ended requests.", names, registry=reg
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens_total", "Generated tokens.", names, registry=reg
        )
        self.running = Gauge(
            "pdserve_requests_running", "Requests in the running batch.", names, registry=reg
        )
        self.waiting = Gauge(
            "pdserve_requests_waiting", "Requests queued for admission.", names, registry=reg
        )
        self.kv_usage = Gauge(
            "pdserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.",
            names, registry=reg,
        )  # fmt: skip
        self.kv_blocks_allocated = Counter(
            "pdserve_kv_blocks_allocated_total",
            "KV cache blocks handed out to requests (a block shared by several, as a "
            "prompt's blocks are by the choices of n > 1, counts once).",
            names, registry=reg,
        )  # fmt: skip
        self.preemptions = Counter(
            "pdserve_preemptions_total", "Requests preempted (KV cache full), to be recomputed.",
            names, registry=reg,
        )  # fmt: skip
        self.step_tokens = Histogram(
            "pdserve_engine_step_tokens", "Tokens computed per engine step.",
            names, buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.step_duration = Histogram(
            "pdserve_engine_step_duration_seconds", "Duration of engine steps.",
            names, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.prefill_chunks = Counter(
            "pdserve_prefill_chunks_total", "Prefill chunks computed.", names, registry=reg
        )
        self.prefix_queries = Counter(
            "pdserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            names, registry=reg,
        )  # fmt: skip
        self.prefix_hits = Counter(
            "pdserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
            names, registry=reg,
        )  # fmt: skip
        self.prefix_hit_rate = Gauge(
            "pdserve_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache / looked up, since start.",
            names, registry=reg,
        )  # fmt: skip
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes_total", "KV cache bytes transferred between workers.",
            names, registry=reg,
        )  # fmt: skip
        self.transfer_duration = Histogram(
            "pdserve_kv_transfer_duration_seconds", "Duration of KV transfers.",
            names, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.transfer_descriptors = Histogram(
            "pdserve_kv_transfer_descriptors", "Contiguous copies per KV transfer.",
            names, buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.transfer_failures = Counter(
            "pdserve_kv_transfer_failures_total", "Hand-offs that failed, by cause.",
            (*names, "reason"), registry=reg,
        )  # fmt: skip
        self.leases_expired = Counter(
            "pdserve_kv_leases_expired_total",
            "Hand-off leases that ran out before their blocks were adopted.",
            names, registry=reg,
        )  # fmt: skip
        self.transfer_peers = Gauge(
            "pdserve_kv_transfer_peers",
            "Peers the KV transfer agent holds connections to (torch: pairs; NIXL: "
            "decode agents loaded by a prefill worker).",
            names, registry=reg,
        )  # fmt: skip
        self.kv_reused_blocks = Counter(
            "pdserve_kv_transfer_saved_blocks_total",
            "Decode side: blocks of handed-off prompts already in this worker's prefix "
            "cache, which the hand-offs did not move.",
            names, registry=reg,
        )  # fmt: skip
        self.kv_reused_bytes = Counter(
            "pdserve_kv_transfer_saved_bytes_total",
            "Decode side: the bytes of those blocks (what a whole-prompt transfer would "
            "have moved on top of pdserve_kv_transfer_bytes_total).",
            names, registry=reg,
        )  # fmt: skip
        self.kv_wait = Histogram(
            "pdserve_kv_wait_seconds",
            "Decode side: request arrival to its KV in place (prefill and transfer).",
            names, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.room_wait = Histogram(
            "pdserve_kv_room_wait_seconds",
            "Decode side: how long hand-offs that found too few free KV blocks for their "
            "prompt waited for requests here to free them (those that found room at once "
            "are not counted; those that never did fell back, "
            "pdserve_kv_transfer_failures_total{reason=\"no_blocks\"}).",
            names, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.handoffs_skipped = Counter(
            "pdserve_kv_handoffs_skipped_total",
            "Decode side: requests that named a prefill worker whose prompt this "
            "worker's prefix cache held but for at most the tokens the pool serves "
            "colocated, which it computed itself (no hand-off, no fallback).",
            names, registry=reg,
        )  # fmt: skip
        self._add_budget_metrics(names)
        self._queries_seen = 0
        self._hits_seen = 0
        self._expired_seen = 0
        self._allocated_seen = 0

    def _add_budget_metrics(self, names: tuple[str, ...]) -> None:
        """The token budget and what the step-cost model believes."""
        reg = self.registry
        self.token_budget = Histogram(
            "pdserve_engine_token_budget", "Token budget given to engine steps that ran prefill.",
            names, buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.step_predicted = Histogram(
            "pdserve_engine_step_predicted_duration_seconds",
            "Duration the step-cost model predicted for each engine step "
            "(compare pdserve_engine_step_duration_seconds).",
            names, buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.steps_over_target = Counter(
            "pdserve_engine_steps_over_target_total",
            "Engine steps whose decodes waited longer than the ITL target for their tokens.",
            names, registry=reg,
        )  # fmt: skip
        self.step_cost = {
            term: Gauge(f"pdserve_engine_step_cost_{term}_seconds", text, names, registry=reg)
            for term, text in STEP_COST_TERMS.items()
        }

    # -- engine side (called on the engine thread) -----------------------------

    def on_step(self, result: StepResult) -> None:
        """Record one engine step."""
        stats, labels = result.stats, self._labels
        self.running.labels(**labels).set(stats.num_running)
        self.waiting.labels(**labels).set(stats.num_waiting)
        self.kv_usage.labels(**labels).set(stats.kv_cache_usage)
        if stats.num_tokens:
            self.step_tokens.labels(**labels).observe(stats.num_tokens)
            self.step_duration.labels(**labels).observe(stats.duration_s)
            self.step_predicted.labels(**labels).observe(stats.predicted_duration_s)
        if stats.num_prefill_chunks:
            self.token_budget.labels(**labels).observe(stats.token_budget)
        if stats.over_target:
            self.steps_over_target.labels(**labels).inc()
        if stats.step_cost is not None:
            self._record_step_cost(stats.step_cost)
        self.preemptions.labels(**labels).inc(stats.num_preemptions)
        self.prefill_chunks.labels(**labels).inc(stats.num_prefill_chunks)
        self.generation_tokens.labels(**labels).inc(
            sum(len(output.new_token_ids) for output in result.outputs)
        )
        self.kv_blocks_allocated.labels(**labels).inc(
            stats.kv_blocks_allocated_total - self._allocated_seen
        )
        self._allocated_seen = stats.kv_blocks_allocated_total
        self._record_prefix(stats.prefix_cache_queries, stats.prefix_cache_hits)
        self.leases_expired.labels(**labels).inc(stats.leases_expired_total - self._expired_seen)
        self._expired_seen = stats.leases_expired_total
        for done in result.finished:
            self.prompt_tokens.labels(**labels).inc(done.num_prompt_tokens)
            if done.first_scheduled_time is not None:
                self.queue_time.labels(**labels).observe(
                    done.first_scheduled_time - done.arrival_time
                )

    def _record_step_cost(self, estimate: StepCostEstimate) -> None:
        for term, gauge in self.step_cost.items():
            gauge.labels(**self._labels).set(getattr(estimate, f"{term}_s"))

    def _record_prefix(self, queries: int, hits: int) -> None:
        if not queries:
            return
        self.prefix_queries.labels(**self._labels).inc(queries)
        self.prefix_hits.labels(**self._labels).inc(hits)
        self._queries_seen += queries
        self._hits_seen += hits
        self.prefix_hit_rate.labels(**self._labels).set(self._hits_seen / self._queries_seen)

    # -- server side (per request, token times as the server saw them) ---------

    def observe_request(
        self,
        num_prompt_tokens: int,
        token_times: Sequence[float],
        arrival: float,
        reason: str,
        mode: str = "colocated",
    ) -> None:
        """Record the latencies of a request that ended."""
        labels = {**self._labels, "bucket": input_bucket(num_prompt_tokens), "mode": mode}
        self.requests.labels(**self._labels, finish_reason=reason).inc()
        if not token_times:
            return
        first, last = token_times[0], token_times[-1]
        self.ttft.labels(**labels).observe(first - arrival)
        self.e2e.labels(**labels).observe(last - arrival)
        for earlier, later in pairwise(token_times):
            self.itl.labels(**labels).observe(later - earlier)
        if len(token_times) > 1:
            self.tpot.labels(**labels).observe((last - first) / (len(token_times) - 1))

    def observe_transfer(self, stats: TransferStats) -> None:
        """Record a finished KV transfer."""
        self.transfer_bytes.labels(**self._labels).inc(stats.bytes)
        self.transfer_duration.labels(**self._labels).observe(stats.seconds)
        self.transfer_descriptors.labels(**self._labels).observe(stats.descriptors)

    def observe_transfer_failure(self, reason: str) -> None:
        """Count a failed hand-off (`reason`: one of the hand-off's known codes)."""
        self.transfer_failures.labels(**self._labels, reason=known_code(reason)).inc()

    def observe_kv_reused(self, blocks: int, num_bytes: int) -> None:
        """Decode side: blocks a hand-off found cached here and did not move."""
        self.kv_reused_blocks.labels(**self._labels).inc(blocks)
        self.kv_reused_bytes.labels(**self._labels).inc(num_bytes)

    def observe_kv_wait(self, seconds: float) -> None:
        """Decode side: how long a request waited for its KV."""
        self.kv_wait.labels(**self._labels).observe(seconds)

    def observe_room_wait(self, seconds: float) -> None:
        """Decode side: how long a hand-off waited for free blocks."""
        self.room_wait.labels(**self._labels).observe(seconds)

    def observe_handoff_skipped(self) -> None:
        """Decode side: a prompt this worker's cache held but a few tokens, computed
        here instead of handed off."""
        self.handoffs_skipped.labels(**self._labels).inc()

    def observe_peers(self, count: int) -> None:
        """How many peers the transfer agent holds connections to now."""
        self.transfer_peers.labels(**self._labels).set(count)

    def observe_error(self, error: APIError) -> None:
        """Count a request answered with an error status."""
        self.rejected.labels(**self._labels, reason=rejection_reason(error)).inc()

    def observe_stream_overflow(self) -> None:
        """Count a request aborted because its tokens waited for its client too long."""
        self.aborted.labels(**self._labels, reason="stream_buffer_full").inc()
