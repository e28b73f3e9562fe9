"""The token-budget scheduler: continuous batching with chunked prefill.

There are no prefill and decode phases. Each step gives each request enough tokens for
its `num_computed_tokens` to catch up with its tokens, under a budget of
`max_num_batched_tokens` and at most `max_num_seqs` running requests. Decodes are
served first (one token each), so a long prompt never delays the streams already
running; prefill chunks fill what is left of the budget. When the KV cache runs out,
the most recently arrived running request is preempted: its blocks are freed and it
is computed again later (recompute), keeping the tokens it already produced.

Prompts, those under way and those waiting alike, take what the decodes leave in the
order of `prefill_order`. "shortest" (the default) serves the prompt with the fewest
tokens left to compute first, a waiting prompt's cached prefix not counted (looked up
without taking its blocks): a prompt that is mostly a prefix-cache hit, or short, is
not held behind a long prompt's chunks, which for a long prompt deep in its context
can take seconds. Nor does a step that computes a prompt's last tokens (and samples
its first token) also run part of a longer prompt: that chunk would make the first
token wait for it, while in a step of its own it costs the longer prompt only the
step's fixed cost; prompts that end in the step too still share it. That is
shortest-remaining-first, which minimises the mean wait; a long prompt only loses the
few steps the short ones take. Against starvation, by
overtakes rather than by the clock (so that a simulated engine makes the same
choices): a prompt that later arrivals were served before, while it still had tokens
to compute, in `max_prefill_overtakes` steps has aged, and aged prompts go first, in
arrival order. So later arrivals run ahead of a prompt in at most that many steps, at
most that many budgets of tokens. "arrival" serves prompts under way before waiting
ones, each in arrival order (first come, first served). Only the first
PREFILL_LOOKAHEAD waiting requests (in arrival order; more if the batch has more
seats) are looked at; later ones wait their turn, so that a long queue costs a step
no more than that many lookups.

With chunking disabled a prompt is prefilled in one step or waits, which is the
baseline that shows what chunking buys. The budget itself comes from a policy
(`budget`): fixed, or chosen each step from the ITL target.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from itertools import islice

from pdserve.workers.engine.budget import (
    REMAINING,
    BatchShape,
    BudgetPolicy,
    PrefillWork,
    StaticBudget,
    fill_prompts,
    static_budget,
)
from pdserve.workers.engine.clock import Clock
from pdserve.workers.engine.config import SchedulerConfig
from pdserve.workers.engine.kv_cache import BlockHash, KVCacheManager
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


# Waiting requests the prefill order looks at each step (see the module's docstring).
PREFILL_LOOKAHEAD = 64


@dataclass(frozen=True)
class _Prompt:
    """A prompt in the prefill order, under way or waiting: its tokens left to compute
    from `start` (a waiting prompt's cached prefix, as looked up), and once planned
    the chunk it gets."""

    request: Request
    start: int
    remaining: int
    waiting: bool
    tokens: int = 0

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    def shortest_first_key(self, max_overtakes: int) -> tuple[bool, float, float]:
        """Aged prompts first, in arrival order; then the fewest tokens left first,
        ties in arrival order."""
        if self.request.prefill_overtakes >= max_overtakes:
            return (False, self.arrival_time, 0.0)
        return (True, float(self.remaining), self.arrival_time)


def _count_overtakes(order: list[_Prompt], granted: dict[Request, int]) -> None:
    """Count a step against each prompt that still had tokens to compute after it while
    a prompt that arrived later was served before it."""
    latest_served = float("-inf")
    for prompt in order:
        request = prompt.request
        if latest_served > request.arrival_time and granted.get(request, 0) < prompt.remaining:
            request.prefill_overtakes += 1
        if request in granted:
            latest_served = max(latest_served, request.arrival_time)


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
        # Waiting requests' prompt block hashes, as far as prefix lookups went, and the
        # token count they are of (a preempted request comes back with more tokens).
        self._probes: dict[Request, tuple[int, list[BlockHash]]] = {}
        # What the last of those lookups found: a waiting prompt's cached prefix is no
        # work left (`prompt_tokens_left`).
        self._found: dict[Request, int] = {}

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

    def prompt_tokens_left(self) -> int:
        """Prompt tokens still to compute, of the running and the waiting requests: a
        waiting prompt's from the end of its cached prefix as the prefill order last
        looked it up (its admission finds those tokens cached and computes only the
        rest), or from its start where it was not looked up yet."""
        left = sum(
            max(0, request.num_prompt_tokens - request.num_computed_tokens)
            for request in self.running
        )
        found = self._found
        for request in self.waiting:
            start = request.num_computed_tokens or found.get(request, 0)
            left += max(0, request.num_prompt_tokens - start)
        return left

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks."""
        budget = token_budget = self.policy.budget(self._shape())
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        scheduled: set[Request] = set()  # the requests of `chunks`
        decodes = sorted(
            (r for r in self.running if not r.is_prefilling), key=lambda r: r.arrival_time
        )
        for request in decodes:
            if budget == 0 or request.status is not RequestStatus.RUNNING:
                continue
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_tokens, scheduled, preempted):
                continue
            chunks.append(ScheduledChunk.of(request, num_tokens))
            scheduled.add(request)
            budget -= num_tokens
        order = self._prefill_queue(admit=not preempted)
        plan = self._plan(self._admissible(order), budget)
        granted: dict[Request, int] = {}
        # Blocks go to the prompts under way first, in arrival order (a preemption takes
        # the latest arrival not yet served, as for decodes), then to the waiting prompts
        # the plan admits, in its order: admitting a prompt never takes blocks from one
        # under way. A waiting prompt whose blocks ran out stops the admissions; what
        # the plan gave it goes to the prompts under way (`_give_unused`).
        running = sorted((p for p in plan if not p.waiting), key=lambda p: p.arrival_time)
        for prompt in running:
            request = prompt.request
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for a prompt that arrived before it
            if self._allocate_or_preempt(request, prompt.tokens, scheduled, preempted):
                granted[request] = prompt.tokens
                scheduled.add(request)
        if not preempted:
            for prompt in (p for p in plan if p.waiting):
                num_tokens = self._admit(prompt.request, prompt.tokens)
                if num_tokens == 0:
                    self._give_unused(order, granted, budget - sum(granted.values()))
                    break
                granted[prompt.request] = num_tokens
        chunks.extend(
            ScheduledChunk.of(p.request, granted[p.request]) for p in order if p.request in granted
        )
        if self.config.prefill_order == "shortest":
            _count_overtakes(order, granted)
        return SchedulerOutput(tuple(chunks), tuple(preempted), token_budget)

    def _give_unused(self, order: list[_Prompt], granted: dict[Request, int], left: int) -> None:
        """Give `left` tokens of the step's budget, which a waiting prompt that could
        not start (its blocks ran out) was planned, to the prompts under way, in
        `order`, as far as free blocks allow (preempting none). Left unused, a waiting
        prompt served first whose blocks are held by a prompt under way would take
        every step's budget, and neither would ever move."""
        for prompt in order:
            if left <= 0:
                return
            request = prompt.request
            if prompt.waiting or request.status is not RequestStatus.RUNNING:
                continue
            have = granted.get(request, 0)
            more = min(prompt.remaining - have, left)
            target = request.num_computed_tokens + have + more
            if more > 0 and self.kv_cache.allocate(request.request_id, target):
                granted[request] = have + more
                left -= more

    def _shape(self) -> BatchShape:
        """The decodes and the prompts awaiting prefill, as `schedule` will take them:
        in its order, a waiting prompt from the end of its cached prefix, and only as
        many waiting prompts as there are free seats."""
        decodes = [r.num_tokens for r in self.running if not r.is_prefilling]
        prefills = tuple(
            PrefillWork(p.start, p.remaining) for p in self._admissible(self._prefill_queue())
        )
        alone = self._first_tokens_alone
        return BatchShape(len(decodes), max(decodes, default=0), prefills, alone, tuple(decodes))

    def _prefill_queue(self, admit: bool = True) -> list[_Prompt]:
        """The prompts under way and (if `admit`) the first waiting ones (as many as
        PREFILL_LOOKAHEAD or the batch's seats), in the order their chunks take the
        budget (see the module's docstring)."""
        prompts = [
            _Prompt(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens, False)
            for r in self.running
            if r.is_prefilling and r.status is RequestStatus.RUNNING
        ]
        if admit:
            lookahead = max(PREFILL_LOOKAHEAD, self.config.max_num_seqs)
            for request in islice(self.waiting, lookahead):
                start = self._cached_prefix(request)
                prompts.append(_Prompt(request, start, request.num_tokens - start, True))
        if self.config.prefill_order == "arrival":
            # Stable: the waiting ones stay in the queue's order (a preempted request
            # back at its arrival's place, a fork's choices at the head).
            prompts.sort(key=lambda p: (p.waiting, 0.0 if p.waiting else p.arrival_time))
        else:
            limit = self.config.max_prefill_overtakes
            prompts.sort(key=lambda p: p.shortest_first_key(limit))
        return prompts

    def _admissible(self, order: list[_Prompt]) -> list[_Prompt]:
        """`order` without the waiting prompts that find no seat: admissions stop at
        the first that does not fit (a choice of n holds n seats from the start)."""
        seats = self.config.max_num_seqs - self._seats_taken()
        admissible = []
        for prompt in order:
            if prompt.waiting:
                if prompt.request.params.n > seats:
                    seats = 0  # no later waiting prompt is admitted either
                    continue
                seats -= prompt.request.params.n
            admissible.append(prompt)
        return admissible

    @property
    def _first_tokens_alone(self) -> bool:
        """Whether a step with a prompt's last tokens runs no part of a longer prompt
        (`fill_prompts`): served shortest first. The plan and the policy's view of the
        step (`_shape`) both ask here, so they fill a step alike."""
        return self.config.prefill_order == "shortest"

    def _plan(self, prompts: list[_Prompt], budget: int) -> list[_Prompt]:
        """Each prompt's chunk, as much as it needs in turn while the budget lasts;
        served shortest first, once a prompt's last tokens are in, only prompts whose
        last tokens also fit (`fill_prompts`, as the budget policy's view fills them).
        Without chunked prefill a waiting prompt is admitted whole or not at all, and
        none after it."""
        admitting = True

        def admits(prompt: _Prompt, left: int) -> bool:
            nonlocal admitting
            if not prompt.waiting:
                return True
            if admitting and not self.config.enable_chunked_prefill and prompt.remaining > left:
                admitting = False
            return admitting

        planned = fill_prompts(prompts, REMAINING, budget, self._first_tokens_alone, admits)
        return [replace(prompt, tokens=tokens) for prompt, tokens in planned]

    def _cached_prefix(self, request: Request) -> int:
        """Tokens of a waiting request the prefix cache holds now, as its admission
        would find them (looked up without taking blocks; its block hashes are kept
        while it waits)."""
        if request.num_computed_tokens or request.needs_prompt_logits:
            return request.num_computed_tokens
        num_tokens, hashes = self._probes.get(request, (-1, []))
        if num_tokens != request.num_tokens:  # new, or preempted with tokens since
            hashes = []
            self._probes[request] = (request.num_tokens, hashes)
        found = self._found[request] = self.kv_cache.cached_prefix_length(
            request.all_token_ids, hashes
        )
        return found

    def _admit(self, request: Request, tokens: int) -> int:
        """Admit a waiting request with a chunk of at most `tokens` tokens, its cached
        prefix attached; the chunk's size, or 0 if it cannot start now (blocks ran out,
        or, without chunked prefill, its prompt no longer fits the chunk)."""
        if request.num_computed_tokens == 0 and not request.needs_prompt_logits:
            _, hashes = self._probes.get(request, (0, None))
            cached = self.kv_cache.find_cached_prefix(
                request.request_id, request.all_token_ids, hashes
            )
            request.num_computed_tokens = cached
            request.num_cached_tokens = min(cached, request.num_prompt_tokens)
        remaining = request.num_tokens - request.num_computed_tokens
        num_tokens = min(remaining, tokens)
        if not self.config.enable_chunked_prefill and remaining > num_tokens:
            self._unschedule(request)
            return 0
        if not self.kv_cache.allocate(request.request_id, request.num_computed_tokens + num_tokens):
            self._unschedule(request)
            return 0
        self.waiting.remove(request)
        self._forget(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        self.running.append(request)
        return num_tokens

    def _forget(self, request: Request) -> None:
        """Drop what lookups kept of a request that no longer waits."""
        self._probes.pop(request, None)
        self._found.pop(request, None)

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
            self._forget(request)
        if free_blocks:
            self.kv_cache.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
