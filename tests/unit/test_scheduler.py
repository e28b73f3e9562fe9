"""The token-budget scheduler on its own (no model): budgets, order, preemption."""

from __future__ import annotations

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.budget import BatchShape, BudgetPolicy, PrefillWork
from pdserve.workers.engine.config import PrefillOrder, SchedulerConfig
from pdserve.workers.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.workers.engine.request import FinishReason, Request
from pdserve.workers.engine.scheduler import Scheduler, SchedulerOutput

PARAMS = SamplingParams(max_tokens=100, temperature=0.0)


def make(
    budget: int = 16,
    blocks: int = 64,
    chunked: bool = True,
    seqs: int = 8,
    policy: BudgetPolicy | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=seqs, enable_chunked_prefill=chunked
    )
    cache = KVCacheManager(BlockPool(blocks), block_size=4)
    return Scheduler(config, cache, max_model_len=1000, policy=policy)


def request(name: str, length: int, arrival: float) -> Request:
    return Request(name, list(range(1, length + 1)), PARAMS, arrival_time=arrival)


def finish_step(scheduler: Scheduler, step: SchedulerOutput) -> None:
    """What the engine does after the forward pass: progress, then sampled tokens."""
    scheduler.update(step)
    for chunk in step.chunks:
        if chunk.samples:
            chunk.request.output_token_ids.append(7)


def test_long_prompt_is_split_into_budget_sized_chunks() -> None:
    scheduler = make(budget=16)
    scheduler.add(request("long", 40, 0.0))
    sizes = []
    for _ in range(3):
        step = scheduler.schedule()
        sizes.append(step.num_tokens)
        finish_step(scheduler, step)
    assert sizes == [16, 16, 8]


def test_decodes_go_first_and_prefill_fills_the_rest() -> None:
    scheduler = make(budget=16)
    scheduler.add(request("short", 3, 0.0))
    finish_step(scheduler, scheduler.schedule())  # prefilled, one token out
    scheduler.add(request("long", 100, 1.0))
    step = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens, c.is_prefill) for c in step.chunks] == [
        ("short", 1, False),
        ("long", 15, True),
    ]


def test_without_chunking_a_prompt_runs_whole_in_one_step() -> None:
    scheduler = make(budget=16, chunked=False)
    scheduler.add(request("long", 40, 0.0))
    step = scheduler.schedule()
    assert step.num_tokens == 40


def test_max_num_seqs_caps_the_batch() -> None:
    scheduler = make(budget=100, seqs=2)
    for index in range(4):
        scheduler.add(request(f"r{index}", 5, float(index)))
    step = scheduler.schedule()
    assert len(step.chunks) == 2 and len(scheduler.waiting) == 2


def test_preemption_takes_the_latest_arrival_and_requeues_it_first() -> None:
    scheduler = make(budget=64, blocks=4)  # 16 tokens of cache
    scheduler.add(request("old", 7, 0.0))
    scheduler.add(request("new", 7, 1.0))
    finish_step(scheduler, scheduler.schedule())  # old and new use 2 blocks each
    scheduler.add(request("later", 3, 2.0))  # finds no block: it waits
    for _ in range(3):
        step = scheduler.schedule()
        finish_step(scheduler, step)
        if step.preempted:
            break
    assert [r.request_id for r in step.preempted] == ["new"]
    assert [r.request_id for r in scheduler.waiting][:1] == ["new"]
    assert scheduler.waiting[0].output_token_ids == [7, 7]  # produced tokens are kept
    assert scheduler.num_preemptions == 1


class ScriptedBudget:
    """A budget policy that hands out the budgets it is given and keeps what it saw."""

    def __init__(self, *budgets: int) -> None:
        self.budgets = list(budgets)
        self.shapes: list[BatchShape] = []

    def budget(self, shape: BatchShape) -> int:
        self.shapes.append(shape)
        return self.budgets.pop(0)

    def step_ended(self, at: float | None) -> None:
        pass


def test_each_step_takes_its_budget_from_the_policy() -> None:
    policy = ScriptedBudget(6, 3, 20, 20)
    scheduler = make(budget=16, seqs=2, policy=policy)
    scheduler.add(request("short", 6, 0.0))
    # Other tokens than the short prompt's: no prefix cache hit.
    scheduler.add(Request("long", list(range(100, 140)), PARAMS, arrival_time=1.0))
    scheduler.add(Request("third", list(range(200, 250)), PARAMS, arrival_time=2.0))
    sizes = []
    for _ in range(4):
        step = scheduler.schedule()
        sizes.append([(c.request.request_id, c.num_tokens) for c in step.chunks])
        assert step.num_tokens <= step.token_budget
        finish_step(scheduler, step)
    assert sizes == [
        [("short", 6)],
        [("short", 1), ("long", 2)],  # decodes first, the prompt gets what is left
        [("short", 1), ("long", 19)],  # 20 asked; seats are full, "third" waits
        [("short", 1), ("long", 19)],
    ]
    # What the policy saw before each step: the decodes, then the prompts in order
    # (waiting ones only while seats are free).
    alone = True  # as the default order, shortest first, fills
    assert policy.shapes[0] == BatchShape(0, 0, (PrefillWork(0, 6), PrefillWork(0, 40)), alone)
    assert policy.shapes[1] == BatchShape(1, 7, (PrefillWork(0, 40),), alone, (7,))
    assert policy.shapes[2] == BatchShape(1, 8, (PrefillWork(2, 38),), alone, (8,))


def make_ordered(
    order: PrefillOrder, budget: int = 16, overtakes: int = 32, blocks: int = 64
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        prefill_order=order,
        max_prefill_overtakes=overtakes,
    )
    cache = KVCacheManager(BlockPool(blocks), block_size=4)
    return Scheduler(config, cache, max_model_len=1000)


def run_to_end(scheduler: Scheduler, request: Request) -> None:
    """Steps until `request` has decoded (its prompt computed, one token out)."""
    while not request.output_token_ids:
        finish_step(scheduler, scheduler.schedule())


def chunks_of(step: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in step.chunks]


def hit_behind_long_prompt(order: PrefillOrder) -> list[tuple[str, int, int]]:
    """A long prompt under way when a prompt arrives whose first 32 of 34 tokens are
    in the prefix cache (an earlier request's): the next step's chunks."""
    scheduler = make_ordered(order, blocks=128)
    system = list(range(1, 33))
    earlier = Request("earlier", [*system, 900], PARAMS, arrival_time=0.0)
    scheduler.add(earlier)
    run_to_end(scheduler, earlier)
    scheduler.finish(earlier, FinishReason.STOP)  # its blocks stay cached
    scheduler.add(Request("long", list(range(1000, 1200)), PARAMS, arrival_time=1.0))
    finish_step(scheduler, scheduler.schedule())  # the long prompt's first chunk
    scheduler.add(Request("hit", [*system, 901, 902], PARAMS, arrival_time=2.0))
    return chunks_of(scheduler.schedule())


def test_a_cache_hit_does_not_wait_behind_a_long_prompt_under_way() -> None:
    # Shortest first: the hit's 2 uncached tokens go before the long prompt's 184, in
    # a step of their own: its first token does not wait for part of the long prompt.
    assert hit_behind_long_prompt("shortest") == [("hit", 32, 2)]


def test_first_come_first_served_keeps_the_hit_waiting() -> None:
    # The order before: the prompt under way takes the whole budget, step after step.
    assert hit_behind_long_prompt("arrival") == [("long", 16, 16)]


def test_a_short_prompt_goes_before_a_long_one_that_arrived_first() -> None:
    scheduler = make_ordered("shortest")
    scheduler.add(Request("long", list(range(1000, 1100)), PARAMS, arrival_time=0.0))
    scheduler.add(Request("short", list(range(2000, 2010)), PARAMS, arrival_time=1.0))
    step = scheduler.schedule()
    assert chunks_of(step) == [("short", 0, 10)]  # its first token in a step of its own
    finish_step(scheduler, step)
    assert chunks_of(scheduler.schedule()) == [("short", 10, 1), ("long", 0, 15)]


def test_prompts_that_end_in_a_step_share_it_and_a_longer_one_waits_for_the_next() -> None:
    """Shortest first, a step that computes a prompt's last tokens takes only prompts
    whose last tokens fit in it too: here two short prompts, not part of the long one
    that arrived before them (first come, first served, the long one leads)."""
    cases: list[tuple[PrefillOrder, list[tuple[str, int, int]]]] = [
        ("shortest", [("a", 0, 4), ("b", 0, 6)]),
        ("arrival", [("long", 0, 16)]),
    ]
    for order, expected in cases:
        scheduler = make_ordered(order)
        scheduler.add(Request("long", list(range(1000, 1100)), PARAMS, arrival_time=0.0))
        scheduler.add(Request("a", list(range(2000, 2004)), PARAMS, arrival_time=1.0))
        scheduler.add(Request("b", list(range(3000, 3006)), PARAMS, arrival_time=2.0))
        assert chunks_of(scheduler.schedule()) == expected


def test_a_long_prompt_is_overtaken_in_at_most_max_prefill_overtakes_steps() -> None:
    """Short prompts that arrive every step and fill the whole budget would starve a
    long prompt served shortest first; after 3 steps it goes first, then shares."""
    scheduler = make_ordered("shortest", budget=8, overtakes=3, blocks=256)
    long = Request("long", list(range(1000, 1040)), PARAMS, arrival_time=0.0)
    scheduler.add(long)
    served: list[int] = []  # the long prompt's tokens in each step
    for step_index in range(12):
        tokens = list(range(2000 + 10 * step_index, 2000 + 10 * step_index + 8))
        scheduler.add(Request(f"short{step_index}", tokens, PARAMS, arrival_time=1.0 + step_index))
        step = scheduler.schedule()
        served.append(sum(c.num_tokens for c in step.chunks if c.request is long))
        finish_step(scheduler, step)
        if long.output_token_ids:
            break
    # Overtaken in steps 1-3 (nothing), then first in every step until it is done:
    # the decodes of the short prompts already computed come first, the rest is its.
    assert served[:3] == [0, 0, 0]
    assert all(tokens > 0 for tokens in served[3:])
    assert sum(served) == 40 and long.prefill_overtakes == 3


def test_the_policy_sees_the_prompts_in_the_order_they_are_served() -> None:
    """The budget policy's view of each step (its prompts, their starts and what is
    left) is what the step then computes: the prompts' chunks in the same order, each
    as much as the budget gives it in turn. Waiting prompts with cached prefixes, a
    long prompt aging, seats filling up."""
    policy = ScriptedBudget(*[12, 16, 20, 9, 16, 5, 16, 16, 30, 16, 16, 16] * 4)
    scheduler = make(budget=16, seqs=4, blocks=256, policy=policy)
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_prefill_overtakes=2)
    scheduler.config = config
    system = list(range(1, 25))
    arrivals = {
        0: [("a", list(range(100, 160)))],
        1: [("b", [*system, 1]), ("c", list(range(300, 309)))],
        3: [("d", [*system, 2, 3, 4, 5]), ("e", list(range(400, 470)))],
        5: [("f", [*system, 6])],
        6: [("g", list(range(500, 505)))],
    }
    for index in range(40):
        for name, tokens in arrivals.get(index, []):
            scheduler.add(Request(name, tokens, PARAMS, arrival_time=float(index)))
        if not scheduler.has_work():
            break
        step = scheduler.schedule()
        shape = policy.shapes[-1]
        left = step.token_budget - shape.num_decodes
        expected = [(work.start, chunk) for work, chunk in shape._chunks(left)]
        computed = [(c.start, c.num_tokens) for c in step.chunks if c.is_prefill]
        assert computed == expected, f"step {index}"
        finish_step(scheduler, step)
        for request in list(scheduler.running):
            if len(request.output_token_ids) >= 3:
                scheduler.finish(request, FinishReason.STOP)
    assert not scheduler.has_work()


def test_a_waiting_prompts_cached_prefix_is_not_counted_as_work_left() -> None:
    """The prompt tokens left to compute (what a worker publishes at /load as its
    backlog) leave out a waiting prompt's cached prefix once the prefill order has
    looked it up: its admission computes only the rest. Before the lookup the whole
    prompt counts; once admitted, the tokens it has left."""
    scheduler = make(budget=16, seqs=1, blocks=128)
    system = list(range(1, 33))
    earlier = Request("earlier", [*system, 900], PARAMS, arrival_time=0.0)
    scheduler.add(earlier)
    run_to_end(scheduler, earlier)
    scheduler.finish(earlier, FinishReason.STOP)  # its blocks stay cached
    long = Request("long", list(range(1000, 1040)), PARAMS, arrival_time=1.0)
    scheduler.add(long)
    finish_step(scheduler, scheduler.schedule())  # 16 of its 40 tokens; the only seat
    hit = Request("hit", [*system, 901, 902], PARAMS, arrival_time=2.0)
    scheduler.add(hit)
    assert scheduler.prompt_tokens_left() == 24 + 34  # not looked up yet: all of it
    finish_step(scheduler, scheduler.schedule())  # no seat for the hit: it waits
    assert hit in scheduler.waiting and long.num_computed_tokens == 32
    assert scheduler.prompt_tokens_left() == 8 + 2
    run_to_end(scheduler, long)
    scheduler.finish(long, FinishReason.STOP)
    finish_step(scheduler, scheduler.schedule())  # admitted: its 2 tokens computed
    assert hit not in scheduler.waiting and scheduler.prompt_tokens_left() == 0


def test_a_waiting_prompt_that_cannot_start_does_not_stall_the_prompt_under_way() -> None:
    """Shortest first, a waiting prompt mostly cached (16 tokens left) goes before a
    prompt under way (44 left), but its blocks run out while that prompt holds
    blocks: the budget the plan gave it goes to the prompt under way, which ends and
    gives its blocks back; then the waiting one starts. (Left unused, the budget went
    to the waiting prompt every step and neither ever moved.)"""
    scheduler = make_ordered("shortest", budget=16, blocks=22)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    system = list(range(1, 61))
    earlier = Request("earlier", system, once, arrival_time=0.0)
    scheduler.add(earlier)
    run_to_end(scheduler, earlier)
    scheduler.finish(earlier, FinishReason.STOP)  # 15 blocks stay cached
    under_way = Request("under way", list(range(1000, 1060)), once, arrival_time=1.0)
    scheduler.add(under_way)
    finish_step(scheduler, scheduler.schedule())  # its first 16 tokens
    hit = Request("hit", [*system, *range(2000, 2016)], once, arrival_time=2.0)
    scheduler.add(hit)

    step = scheduler.schedule()
    assert chunks_of(step) == [("under way", 16, 16)]
    finish_step(scheduler, step)
    for _ in range(10):
        if under_way.output_token_ids:
            break
        step = scheduler.schedule()
        assert step.chunks  # no step stalls
        finish_step(scheduler, step)
    scheduler.finish(under_way, FinishReason.LENGTH)
    run_to_end(scheduler, hit)
