"""The token-budget scheduler on its own (no model): budgets, order, preemption."""

from __future__ import annotations

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.budget import BatchShape, BudgetPolicy, PrefillWork
from pdserve.workers.engine.config import SchedulerConfig
from pdserve.workers.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.workers.engine.request import Request
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
    scheduler.add(request("later", 3, 2.0))
    finish_step(scheduler, scheduler.schedule())  # old and new use 2 blocks each
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
    scheduler.add(request("third", 5, 2.0))
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
    assert policy.shapes[0] == BatchShape(0, 0, (PrefillWork(0, 6), PrefillWork(0, 40)))
    assert policy.shapes[1] == BatchShape(1, 7, (PrefillWork(0, 40),))
    assert policy.shapes[2] == BatchShape(1, 8, (PrefillWork(2, 38),))
