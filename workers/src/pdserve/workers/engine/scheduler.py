"""The token-budget scheduler: continuous batching with chunked prefill.

There are no prefill and decode phases. Each step gives each request enough tokens for
its `num_computed_tokens` to catch up with its tokens, under a budget of
`max_num_batched_tokens` and at most `max_num_seqs` running requests. Decodes are
served first (one token each), so a long prompt never delays the streams already
running; prefill chunks fill what is left of the budget. When the KV cache runs out,
the most recently arrived running request is preempted: its blocks are freed and it
is computed again later (recompute), keeping the tokens it already produced.

With chunking disabled a prompt is prefilled in one step or waits, which is the
baseline that shows what chunking buys. The budget itself comes from a policy
(`budget`): fixed, or chosen each step from the ITL target.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

from pdserve.workers.engine.budget import (
    BatchShape,
    BudgetPolicy,
    PrefillWork,
    StaticBudget,
    static_budget,
)
from pdserve.workers.engine.clock import Clock
from pdserve.workers.engine.config import SchedulerConfig
from pdserve.workers.engine.kv_cache import KVCacheManager
from pdserve.workers.engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of a request, computed in this step."""

    request: Request
    start: int
    num_tokens: int
    is_prefill: bool  # computes prompt (or recomputed) tokens rather than one decode

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> ScheduledChunk:
        """The next `num_tokens` tokens of `request`."""
        return cls(request, request.num_computed_tokens, num_tokens, request.is_prefilling)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so the step
        samples the request's next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work: the chunks to run (decodes first), who was preempted, and
    the token budget the step was given."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...]
    token_budget: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the step."""
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_prefill_chunks(self) -> int:
        """Chunks that compute prompt (or recomputed) tokens rather than one decode."""
        return sum(1 for chunk in self.chunks if chunk.is_prefill)


class Scheduler:
    """Decides what each engine step computes, under the budget `policy` gives each
    step (default: the static budget of `config`)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        policy: BudgetPolicy | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.kv_cache = kv_cache
        self.policy = policy or StaticBudget(static_budget(config, max_model_len))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a new request."""
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose tokens are already in the cache (adopted from a
        prefill worker): it decodes from the next step on."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_work(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks."""
        budget = token_budget = self.policy.budget(self._shape())
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        # Decodes first, then prompts already under way, each group in arrival order.
        ordered = sorted(self.running, key=lambda r: (r.is_prefilling, r.arrival_time))
        scheduled: set[Request] = set()  # the requests of `chunks`
        for request in ordered:
            if budget == 0 or request.status is not RequestStatus.RUNNING:
                continue
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_tokens, scheduled, preempted):
                continue
            chunks.append(ScheduledChunk.of(request, num_tokens))
            scheduled.add(request)
            budget -= num_tokens
        if not preempted:
            budget = self._schedule_waiting(budget, chunks)
        return SchedulerOutput(tuple(chunks), tuple(preempted), token_budget)

    def _shape(self) -> BatchShape:
        """The decodes and the prompts awaiting prefill, as `schedule` will take them
        (only as many waiting prompts as there are free seats)."""
        decodes = [r.num_tokens for r in self.running if not r.is_prefilling]
        prefilling = sorted(
            (r for r in self.running if r.is_prefilling), key=lambda r: r.arrival_time
        )
        seats = max(0, self.config.max_num_seqs - self._seats_taken())
        queued = [*prefilling, *islice(self.waiting, seats)]
        prefills = tuple(
            PrefillWork(r.num_computed_tokens, r.num_tokens - r.num_computed_tokens) for r in queued
        )
        return BatchShape(len(decodes), max(decodes, default=0), prefills)

    def _allocate_or_preempt(
        self,
        request: Request,
        num_tokens: int,
        scheduled: set[Request],
        preempted: list[Request],
    ) -> bool:
        """Make room for a running request's chunk, preempting the latest arrivals that
        are not part of this step. False if the request itself had to go."""
        target = request.num_computed_tokens + num_tokens
        while not self.kv_cache.allocate(request.request_id, target):
            victims = [r for r in self.running if r not in scheduled and r is not request]
            victim = max(victims, key=lambda r: r.arrival_time, default=request)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Admit waiting requests in arrival order while budget, seats and blocks last."""
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self._seats_taken() + request.params.n > self.config.max_num_seqs:
                break
            if request.num_computed_tokens == 0 and not request.needs_prompt_logits:
                cached = self.kv_cache.find_cached_prefix(request.request_id, request.all_token_ids)
                request.num_computed_tokens = cached
                request.num_cached_tokens = min(cached, request.num_prompt_tokens)
            remaining = request.num_tokens - request.num_computed_tokens
            if not self.config.enable_chunked_prefill and remaining > budget:
                self._unschedule(request)
                break
            num_tokens = min(remaining, budget)
            if not self.kv_cache.allocate(
                request.request_id, request.num_computed_tokens + num_tokens
            ):
                self._unschedule(request)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            self.running.append(request)
            chunks.append(ScheduledChunk.of(request, num_tokens))
            budget -= num_tokens
        return budget

    def _seats_taken(self) -> int:
        """Seats of the running batch in use: a request that will fork into n choices
        holds n from the start, so the fork never overfills the batch."""
        return sum(request.params.n for request in self.running)

    def _unschedule(self, request: Request) -> None:
        """Give back the prefix-cache blocks a waiting request picked up this step."""
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        # Back to the head of the queue, ahead of requests that arrived later.
        position = sum(1 for r in self.waiting if r.arrival_time < request.arrival_time)
        self.waiting.insert(position, request)

    def update(self, output: SchedulerOutput) -> None:
        """Account for a finished step: progress and full blocks (sampling is done)."""
        for chunk in output.chunks:
            self.update_chunk(chunk)

    def update_chunk(self, chunk: ScheduledChunk) -> None:
        """Account for one chunk a step computed: its request's progress and full
        blocks."""
        request = chunk.request
        request.num_computed_tokens = chunk.start + chunk.num_tokens
        if self.kv_cache.has_new_full_blocks(request.request_id, request.num_computed_tokens):
            self.kv_cache.cache_full_blocks(
                request.request_id, request.all_token_ids, request.num_computed_tokens
            )

    def fork(self, parent: Request, running: list[Request], waiting: list[Request]) -> None:
        """Replace a running request by its choices: those holding blocks run from the
        next step, the others wait at the head of the queue to compute the prompt again
        (blocks ran out for them)."""
        self.running.remove(parent)
        for choice in running:
            choice.status = RequestStatus.RUNNING
            self.running.append(choice)
        for choice in reversed(waiting):
            choice.status = RequestStatus.WAITING
            self.waiting.appendleft(choice)

    def finish(self, request: Request, reason: FinishReason, free_blocks: bool = True) -> None:
        """End a request (stopped, too long, or aborted); free its blocks unless the
        caller keeps them (a prefill worker's blocks wait for their transfer)."""
        if request.is_finished:
            return
        # By membership, not status: a request that forked left the running batch
        # to its choices while still marked running.
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_blocks:
            self.kv_cache.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
