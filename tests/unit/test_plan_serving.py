"""What a serving worker adds to its steps, read from its own clock: each step's
cadence (the time from the previous step's tokens to its own, in its step log) beyond
the model's compute, over the steps that ran the whole batch of streams, per batch
and round; each batch's median over the rounds is fitted as fixed plus per token."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.workers.plan.costs import StepCost
from pdserve.workers.plan.pair import fit_serving
from pdserve.workers.plan.step_log import LoggedStep, cadence_beyond, read_steps, read_steps_from

COST = StepCost(
    base_s=0.004, per_decode_token_s=0.001, per_prefill_token_s=0.0001,
    per_decode_key_s=0.0, per_prefill_key_s=0.0,
)  # fmt: skip

LOG = """\
DEBUG pdserve.workers.engine.steps: step warm-up-0@0+64
DEBUG pdserve.workers.engine.step_timing: budget=512 tokens=64 predicted=0.0ms took=9.0ms since_last_tokens=9.0ms
DEBUG pdserve.workers.engine.steps: step a@40+1 b@40+1
DEBUG pdserve.workers.engine.step_timing: budget=512 tokens=2 predicted=6.0ms took=6.0ms since_last_tokens=7.5ms
DEBUG pdserve.workers.engine.steps: step a@41+1 b@41+1
DEBUG pdserve.workers.engine.step_timing: tokens=2 took=6.0ms
"""  # noqa: E501


def batch(decodes: int, beyond_s: float) -> LoggedStep:
    """A decode-only step of `decodes` streams whose cadence ran `beyond_s` past the
    model's compute."""
    spans = tuple((64 + i, 1) for i in range(decodes))
    compute = COST.base_s + COST.per_decode_token_s * decodes
    return LoggedStep(spans, compute, compute + beyond_s)


def test_a_step_log_line_gives_the_steps_cadence_where_it_tells_it(tmp_path: Path) -> None:
    steps = read_steps(LOG)
    assert [step.interval_s for step in steps] == [pytest.approx(0.0075), None]
    log = tmp_path / "worker.log"
    log.write_text(LOG)
    assert read_steps_from(log, LOG.index("DEBUG pdserve.workers.engine.steps: step a@41")) == [
        steps[1]
    ]


def test_only_the_steps_that_ran_the_whole_batch_count() -> None:
    # The batch filling up (fewer decodes), a prompt's step and a step without its
    # cadence are left out; of the rest, the median: one stalled step moves nothing.
    steps = [
        batch(2, 0.009),
        batch(4, 0.001),
        LoggedStep(((0, 128), *((64 + i, 1) for i in range(4))), 0.05, 0.06),
        batch(4, 0.0012),
        batch(4, 0.030),  # another process took the core
        LoggedStep(tuple((64 + i, 1) for i in range(4)), 0.1),
        batch(4, 0.0011),
    ]
    assert cadence_beyond(steps, 4, COST) == pytest.approx(0.00115)
    assert cadence_beyond(steps, 8, COST) is None  # no step ran eight


def test_a_round_that_ran_slow_does_not_move_the_serving_figures() -> None:
    # Serving adds 1 ms a step and 0.1 ms a token; the second round ran 3 ms slower.
    true = {n: 0.001 + 0.0001 * n for n in (1, 4, 8, 16)}
    slow = {n: seconds + 0.003 for n, seconds in true.items()}
    serving, spreads = fit_serving([true, slow, true])
    assert serving.fixed_s == pytest.approx(0.001)
    assert serving.per_token_s == pytest.approx(0.0001)
    assert [n for n, _ in serving.samples] == [1, 4, 8, 16]
    assert spreads["serving.fixed_s"].rounds == pytest.approx((0.001, 0.004, 0.001))
    assert spreads["serving.beyond_s.16"].rounds == pytest.approx((0.0026, 0.0056, 0.0026))


def test_serving_never_reads_as_negative() -> None:
    serving, _ = fit_serving([{1: -0.002, 4: -0.001, 8: 0.0, 16: 0.0004}])
    assert serving.fixed_s >= 0
    assert serving.per_token_s >= 0
