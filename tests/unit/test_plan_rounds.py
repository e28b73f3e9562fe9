"""A profile that holds still between runs: the sweep visits its grid in rounds, each
in an order of its own, and the fit takes each point's median over the rounds, so a
machine whose pace drifts while the sweep runs, a batch that ran slow while it was
measured, and single steps slowed by another process do not move the costs; each
round fitted alone gives the costs' spread. Workers stepping together are timed in
rounds too, each level against the lone worker of its own round."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pdserve.workers.plan.contention import fit_slope, median_slowdowns, round_slowdowns
from pdserve.workers.plan.costs import Profile, Spread, StepCost, StepSample
from pdserve.workers.plan.fit import fit_with_error, round_costs
from pdserve.workers.plan.profile import cost_spreads
from pdserve.workers.plan.sweep import (
    DESIGNS,
    Sweep,
    SweepPoint,
    design_points,
    measurement_order,
)
from support.engine import make_engine
from support.plan import constant_profile, model_config_dir

# Costs of the order this machine's profiles measure.
TRUE = StepCost(
    base_s=0.004,
    per_decode_token_s=1e-4,
    per_prefill_token_s=6e-5,
    per_decode_key_s=6e-7,
    per_prefill_key_s=7e-8,
)
Measured = list[tuple[SweepPoint, StepSample]]


def grid() -> list[SweepPoint]:
    """The full design's points."""
    return [
        SweepPoint(context, decodes, prefill, start)
        for context in (64, 256, 1024)
        for decodes in (0, 1, 4, 16, 32)
        for start in (0, 512)
        for prefill in (0, 32, 128, 512)
        if prefill or (decodes and not start)
    ]


def in_rounds(rounds: int) -> list[tuple[int, SweepPoint]]:
    """(round, point) in the order the sweep measures them."""
    return [
        (round_, point)
        for round_, _, points in measurement_order(grid(), rounds)
        for point in points
    ]


def in_one_pass(repeats: int) -> list[tuple[int, SweepPoint]]:
    """(round, point) in the grid's order, batch by batch, each point `repeats` times."""
    points = grid()
    batches = sorted({(p.context, p.decodes) for p in points})
    return [
        (0, point)
        for batch in batches
        for point in points
        if (point.context, point.decodes) == batch
        for _ in range(repeats)
    ]


def timed(order: list[tuple[int, SweepPoint]], seed: int) -> Measured:
    """The steps as a disturbed machine times them, in `order`: its pace drifts from
    0.85x to 1.15x over the sweep, a batch visit in six runs 5 ms longer a step
    (another process had the core meanwhile), one step in twenty takes 2-4x, and
    every step is off by up to 3%."""
    rng = np.random.default_rng(seed)
    visits = np.cumsum([
        index == 0 or (order[index - 1][0], order[index - 1][1].context,
                       order[index - 1][1].decodes) != (r, p.context, p.decodes)
        for index, (r, p) in enumerate(order)
    ])  # fmt: skip
    slow_visits = rng.random(int(visits[-1]) + 1) < 1 / 6
    steps: dict[tuple[int, SweepPoint], int] = {}
    measured = []
    for index, (round_, point) in enumerate(order):
        step = steps.get((round_, point), 0)
        steps[(round_, point)] = step + 1
        sample = StepSample(
            decode_tokens=point.decodes,
            prefill_tokens=point.prefill,
            decode_keys=point.decodes * (point.context + step),
            prefill_keys=point.prefill * (point.start + point.prefill),
            seconds=1.0,
            round=round_,
        )
        seconds = TRUE.seconds(sample.features) * (0.85 + 0.3 * index / len(order))
        seconds *= 1 + rng.uniform(-0.03, 0.03)
        if slow_visits[visits[index]]:
            seconds += 0.005
        if rng.random() < 0.05:
            seconds *= rng.uniform(2.0, 4.0)
        measured.append((point, sample.model_copy(update={"seconds": seconds})))
    return measured


def off(cost: StepCost) -> dict[str, float]:
    """Each cost over the true one."""
    return {name: getattr(cost, name) / value for name, value in TRUE.model_dump().items()}


def test_each_round_visits_every_point_once_in_an_order_of_its_own() -> None:
    points = grid()
    order = measurement_order(points, 3)
    for round_ in range(3):
        visited = [p for r, _, batch in order if r == round_ for p in batch]
        assert sorted(visited, key=repr) == sorted(points, key=repr)
    batches = [[batch for r, batch, _ in order if r == round_] for round_ in range(3)]
    assert len({tuple(b) for b in batches}) == 3
    # A batch's points are measured together, beside its decodes.
    assert all(all((p.context, p.decodes) == batch for p in ps) for _, batch, ps in order)
    assert measurement_order(points, 3) == order  # seeded: the same sweep every run


def test_rounds_recover_the_costs_through_drift_slow_batches_and_outliers() -> None:
    for seed in range(3):
        cost, error = fit_with_error(timed(in_rounds(3), seed))
        ratios = off(cost)
        assert error.rounds == 3
        for name in ("base_s", "per_prefill_token_s", "per_decode_key_s", "per_prefill_key_s"):
            assert ratios[name] == pytest.approx(1.0, abs=0.15), (seed, name)
        # The smallest term of a step (0.1 ms a decode beside a 4 ms base and its
        # keys' cost) is the least sure: within half as much again.
        assert 1 / 1.5 < ratios["per_decode_token_s"] < 1.5, seed


def test_one_pass_in_the_grids_order_reads_the_drift_as_a_cost() -> None:
    # The contexts are measured in order, the longest last: the machine slowing down
    # meanwhile is fitted as the keys' cost.
    for seed in range(3):
        ratios = off(fit_with_error(timed(in_one_pass(3), seed))[0])
        assert ratios["per_decode_key_s"] > 1.2, seed


def test_each_rounds_fit_gives_the_costs_spread() -> None:
    measured = timed(in_rounds(3), seed=0)
    costs = round_costs(measured, paced=False)
    assert len(costs) == 3
    spreads = cost_spreads(costs)
    assert set(spreads) == {f"step_cost.{name}" for name in StepCost.model_fields}
    base = spreads["step_cost.base_s"]
    assert base.rounds == tuple(cost.base_s for cost in costs)
    assert base.low is not None and base.high is not None
    assert base.low <= fit_with_error(measured)[0].base_s * 1.1
    assert base.high >= fit_with_error(measured)[0].base_s * 0.9


def test_exact_steps_give_every_round_the_true_costs() -> None:
    exact = [
        (point, sample.model_copy(update={"seconds": TRUE.seconds(sample.features)}))
        for point, sample in timed(in_rounds(3), seed=0)
    ]
    for cost in round_costs(exact, paced=False):
        for name, ratio in off(cost).items():
            assert ratio == pytest.approx(1.0, rel=0.02), name


def test_a_round_that_ran_slow_does_not_move_a_levels_slowdown() -> None:
    # Pair times by level in three rounds; in the second, another process took the
    # cores while three workers stepped (the highest level, measured last in one pass).
    rounds = [
        {1: 0.020, 2: 0.021, 3: 0.031},
        {1: 0.020, 2: 0.022, 3: 0.050},
        {1: 0.024, 2: 0.025, 3: 0.037},  # the whole round slower: its own lone worker too
    ]
    per_round = [round_slowdowns(medians) for medians in rounds]
    assert per_round[2][2] == pytest.approx(0.025 / 0.024)
    samples = median_slowdowns(per_round)
    assert [count for count, _ in samples] == [1, 2, 3]
    assert [slowdown for _, slowdown in samples] == pytest.approx([1.0, 1.05, 1.55])
    steady = fit_slope(samples, cores=2, threads=1)
    assert steady == pytest.approx(fit_slope(((1, 1.0), (2, 1.05), (3, 1.55)), 2, 1))
    assert fit_slope(tuple(per_round[1].items()), 2, 1) > steady + 0.3


def test_a_spread_names_its_rounds_range() -> None:
    spread = Spread(rounds=(0.004, 0.005, 0.0045))
    assert (spread.low, spread.high) == (0.004, 0.005)
    assert spread.relative(0.0045) == pytest.approx(0.001 / 0.0045)
    assert Spread(rounds=(0.004,)).relative(0.004) is None
    assert Spread().low is None


def test_a_profile_keeps_its_spreads_and_one_without_them_loads(tmp_path: Path) -> None:
    profile = constant_profile(model_config_dir(tmp_path), 0.01)
    assert profile.spreads == {}
    kept = profile.model_copy(update={"spreads": {"contention.slope": Spread(rounds=(0.1, 0.2))}})
    again = Profile.model_validate_json(kept.model_dump_json())
    assert again.spreads["contention.slope"].rounds == (0.1, 0.2)


def test_a_real_sweep_measures_every_point_each_round_beside_all_its_decodes(
    small_model_dir: Path,
) -> None:
    # The quick design at contexts long enough that building a batch takes steps of
    # its own: each decode keeps tokens to draw until its batch's points are measured.
    design = replace(DESIGNS["quick"], contexts=(32, 512), decodes=(0, 16), rounds=2)
    engine = make_engine(small_model_dir, num_blocks=1024)
    measured = Sweep(engine).run(design)

    points = list(design_points(design, engine))
    for round_ in (0, 1):
        mine = sorted((p for p, s in measured if s.round == round_), key=repr)
        assert mine == sorted(points, key=repr)
    assert all(sample.decode_tokens == point.decodes for point, sample in measured)
    assert all(sample.prefill_tokens == point.prefill for point, sample in measured)
