"""KV-aware choice of a worker, and the P/D decision on uncached tokens.

A worker's cost for a request is its predicted time to first token there
(`kv_costs`): the prompt tokens it would compute (those not in its prefix cache, from
the router's index; at least one, the step that samples) after the prompt tokens
waiting to be prefilled in it that its engine serves first (the router's own count of
what it sent, each prompt's uncached tokens kept, and what the worker published beyond
it; an engine that serves the shortest prompt first, as it publishes at /load, computes
only the shorter waiting prompts and at most the step under way before a new one, see
`Worker.prefill_ahead`), at what its own steps cost per token (its prefill costs drawn
toward its peers' while it has learned them from few prompts, `kv_costs`), plus what the
requests it is decoding add to each of those steps. The cheapest worker wins; a
prediction within a millisecond of the best is a tie, and ties go to the less loaded,
then to chance. With `loadWeightTokens` set, the cost is counted in tokens instead:
the uncached and waiting prompt tokens plus that weight per request it holds (the
rule before time was predicted, kept as an override). A worker whose batch has no
seat left, or whose cache lacks free blocks for the prompt and those queued before
it, is predicted to wait for its running requests to end (`kv_room`, from what it
publishes at /load), so a cached worker packed full loses to an idle one, unless it
holds enough of the prompt that waiting there is still quicker. A decode worker that
does not publish that, and whose KV cache is nearly full, is passed over while another
is not, as by load alone. A worker whose feed is not synced (starting, refused by the
handshake, unreachable) holds nothing in the index: it competes on load alone.

The index learns a prompt's blocks once the worker has computed them. Until then the
router knows them from what it sent: a prompt that shares its first blocks with one
sent to a worker and not yet answered may wait there for that one (an engine serving
the shortest first serves that one first, this one's prefix not being cached yet)
and then find those blocks cached; that is priced as well, and taken where sooner
(`Worker.pending_blocks`), so that requests sharing a new prefix that arrive together
land where it is being computed rather than computing it again elsewhere.

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
from typing import NamedTuple, Protocol

from pdserve.protocol.headers import header_count
from pdserve.protocol.routing import Mode, Role, RoutingTable
from pdserve.workers.router.kv_costs import StepCosts, priced_costs
from pdserve.workers.router.kv_index import BlockKey, KVIndex
from pdserve.workers.router.kv_keys import prompt_block_keys
from pdserve.workers.router.kv_metrics import KVRoutingMetrics
from pdserve.workers.router.workers import KV_NEARLY_FULL, Worker, WorkerSet

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KVPrompt:
    """What KV-aware routing needs of a request: its blocks' keys and the table (not
    changed once made; not frozen: made for every request, as is a KVChoice)."""

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
        keys = prompt_block_keys(token_ids, policy.block_size, policy.hash_seed)
        return cls(keys, len(token_ids), table)


class KVIndexes(Protocol):
    """Where the index of each role is kept: the router's feeds (`KVFeeds`), or a
    simulated pool's router."""

    @property
    def indexes(self) -> Mapping[Role, KVIndex]:
        """The index of each role."""
        ...


@dataclass(slots=True)
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
            step_costs = priced_costs({w.url: w.step_costs() for w in candidates})
            costs = {}
            for worker in candidates:
                steps = step_costs[worker.url]
                costs[worker.url] = self._cost(worker, prompt, cached[worker.url], now, steps)
                # Blocks a prompt sent it will hold once computed: the index learns them
                # only then, but the engine, serving that prompt first, lets this one
                # find them cached if it waits for it.
                blocks, before = worker.pending_blocks(prompt.keys)
                pending = min(blocks, usable) * policy.block_size
                if pending > cached[worker.url]:
                    waiting = self._cost(worker, prompt, pending, now, steps, before)
                    if waiting < costs[worker.url]:
                        costs[worker.url], cached[worker.url] = waiting, pending
            best = min(candidates, key=lambda w: costs[w.url])
        most = max(cached.values())
        reason = "none" if most <= 0 else "cache" if cached[best.url] == most else "load"
        self.metrics.chose(workers.role, reason, prompt.tokens, cached[best.url])
        return KVChoice(best, cached[best.url], reason)

    def _cost(
        self,
        worker: Worker,
        prompt: KVPrompt,
        cached: int,
        now: float,
        costs: StepCosts,
        before: int = 0,
    ) -> tuple[float, ...]:
        """The worker's cost, at its step `costs`, its `cached` tokens found once the
        `before` tokens of a prompt it computes first are done (that prompt's blocks
        among them)."""
        load = _Load(worker.requests(now), worker.waiting_prefill_tokens(now))
        work = _expected_work(worker, prompt, cached, load, now, costs, before)
        # The last keys break ties: the less loaded, then chance (equal workers share
        # the traffic).
        if worker.role == "prefill":
            return (work, load.waiting, load.requests, random.random())
        # A decode worker prefills colocated requests itself: their backlog is work too.
        usage = worker.kv_cache_usage(now)
        # Where the worker publishes its room, the wait for blocks is predicted instead.
        full = float(usage >= KV_NEARLY_FULL and worker.room(now) is None)
        uncached = prompt.tokens - cached
        return (full, work, load.requests, uncached + load.waiting, usage, random.random())

    def observed(
        self, request_id: str, prompt: KVPrompt, predicted: int, found: str | None
    ) -> None:
        """The decode worker's answer says its engine found `found` prompt tokens cached
        (its X-Pdserve-Cached-Tokens header; None or unusable: unknown), where the
        index predicted `predicted`: counted, and logged when they differ."""
        actual = header_count(found, prompt.tokens)  # a peer's word: within the prompt
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


class _Load(NamedTuple):
    """A worker's load as scoring sees it: requests held, prompt tokens waiting (made
    per worker for every request scored: a tuple, not a frozen dataclass, whose fields
    are each set through `object.__setattr__`)."""

    requests: int
    waiting: int


def _expected_work(
    worker: Worker,
    prompt: KVPrompt,
    cached: int,
    load: _Load,
    now: float,
    costs: StepCosts,
    before: int = 0,
) -> float:
    """A worker's cost for the prompt at its step `costs`: its predicted time to
    first token in whole milliseconds (closer predictions are ties), or with
    `loadWeightTokens` set, tokens.
    With `before`, the prompt waits for a prompt of that many tokens (whose blocks it
    then finds cached): it is served after what the worker's order serves before that
    one, and that one."""
    uncached = prompt.tokens - cached
    weight = prompt.table.routing_policy.load_weight_tokens
    if weight is not None:
        return float(uncached + load.waiting + weight * load.requests)
    # A prefill worker decodes nothing: what it holds are prompts, already counted.
    decoding = 0 if worker.role == "prefill" else load.requests
    # Only the waiting prompts its engine's order serves before this one delay it.
    ahead = worker.prefill_ahead(before or uncached, now, costs.step_tokens)
    needed = -(-(ahead + uncached) // prompt.table.routing_policy.block_size)
    wait = _wait_steps(worker, load, needed, now, costs.step_s(decoding))
    return float(round(costs.ttft_s(ahead, uncached, cached, decoding, wait) * 1000))


def _wait_steps(worker: Worker, load: _Load, blocks: int, now: float, step_s: float) -> float:
    """Steps a request needing `blocks` new KV blocks (its own uncached tokens' and the
    queued prompts') would wait on `worker` for a seat or blocks, less those run since
    the worker published its room (none when it has not published lately)."""
    published = worker.room(now)
    if published is None:
        return 0.0
    room, at = published
    elapsed = (now - at) / step_s if step_s > 0 else 0.0
    return max(0.0, room.wait_steps(load.requests, blocks) - elapsed)
