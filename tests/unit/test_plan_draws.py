"""A prediction is the simulator's expectation, not one draw: the steps' spread (and
the router's ties) are drawn with a seed, and one seed's P99 can sit several percent
from another's. `simulate` runs the scenario once per draw, each with seeds of its
own, and reports every figure as the mean of the draws' with its spread across them."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.plan.costs import Profile, ServingOverhead, StepSpread
from pdserve.workers.plan.pool import Traffic
from pdserve.workers.plan.results import mean_of_draws
from pdserve.workers.plan.scenario import Scenario, parse_scenario
from pdserve.workers.plan.simulate import DRAWS, simulate, simulate_draw
from support.plan import constant_profile, model_config_dir, scenario_line

STEP_S = 0.01
# One step in ten waits out a time slice and takes four times as long.
SLICED = [1.0] * 90 + [4.0] * 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scenario, Profile, Traffic]:
    model_dir = model_config_dir(tmp_path_factory.mktemp("model"))
    serving = ServingOverhead(spread=StepSpread.of(SLICED))
    profile = constant_profile(model_dir, STEP_S).model_copy(update={"serving": serving})
    line = scenario_line("draws", ["--max-num-batched-tokens", "64"], num_decode=2)
    plan = [PlannedRequest(i, 0.05 * i, 48, 40, "t") for i in range(12)]
    return parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None)


def without_timing(result: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in result.items() if key != "wall_s"}


def p99(result: dict[str, Any], metric: str) -> float:
    return float(result["overall"][metric]["p99"])


def test_the_same_draws_give_the_same_prediction(
    setup: tuple[Scenario, Profile, Traffic],
) -> None:
    first, second = simulate(*setup, draws=3), simulate(*setup, draws=3)
    assert without_timing(first) == without_timing(second)
    assert first["draws"] == 3


def test_each_draw_draws_its_own_steps(setup: tuple[Scenario, Profile, Traffic]) -> None:
    tails = {p99(simulate_draw(*setup, draw), "e2e_s") for draw in range(DRAWS)}
    assert len(tails) > 1  # the draws differ, so their mean says more than one of them


def test_the_prediction_is_the_mean_of_single_draws(
    setup: tuple[Scenario, Profile, Traffic],
) -> None:
    singles = [simulate_draw(*setup, draw) for draw in range(3)]
    mean = simulate(*setup, draws=3)
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        values = [p99(single, metric) for single in singles]
        assert p99(mean, metric) == pytest.approx(statistics.fmean(values))
        spread = mean["spread"]["overall"][metric]["p99"]
        assert spread == pytest.approx(statistics.pstdev(values))
    rates = [s["output_throughput"] for s in singles]
    assert mean["output_throughput"] == pytest.approx(statistics.fmean(rates))
    assert mean["requests"] == 12  # a count every draw agrees on stays whole


def test_one_draw_is_the_simulation_as_it_always_ran(
    setup: tuple[Scenario, Profile, Traffic],
) -> None:
    one = simulate(*setup, draws=1)
    assert without_timing(one) == {**without_timing(simulate_draw(*setup)), "draws": 1}
    assert "spread" not in one  # nothing to spread over


def test_a_figure_no_draw_has_stays_none_and_one_some_lack_is_their_mean() -> None:
    draws = [
        {"goodput": 1.0, "slo_attainment": 0.5, "overall": {"ttft_s": None},
         "buckets": {"<=256": {"ttft_s": {"p99": 0.2}}, ">256": None}},
        {"goodput": 2.0, "slo_attainment": 0.5, "overall": {"ttft_s": None},
         "buckets": {"<=256": {"ttft_s": {"p99": 0.4}}, ">256": {"ttft_s": {"p99": 1.0}}}},
    ]  # fmt: skip
    mean = mean_of_draws(draws)
    assert mean["goodput"] == 1.5
    assert mean["overall"] == {"ttft_s": None}
    assert mean["buckets"]["<=256"]["ttft_s"]["p99"] == pytest.approx(0.3)
    assert mean["buckets"][">256"]["ttft_s"]["p99"] == 1.0
    assert mean["spread"]["goodput"] == pytest.approx(0.5)
    assert mean["spread"]["slo_attainment"] == 0.0


def test_a_mode_a_draw_did_not_serve_counts_as_none_of_its_requests() -> None:
    figures = {"goodput": 1.0, "slo_attainment": 1.0, "overall": None, "buckets": None}
    draws = [
        {**figures, "modes": {">512": {"disaggregated": 4, "colocated": 6}}},
        {**figures, "modes": {">512": {"colocated": 10}}},
        {**figures, "modes": {"<=512": {"colocated": 10}}},
    ]
    modes = mean_of_draws(draws)["modes"]
    assert modes[">512"]["disaggregated"] == pytest.approx(4 / 3)  # not 4: two draws had 0
    assert modes[">512"]["colocated"] == pytest.approx(16 / 3)
    assert modes["<=512"]["colocated"] == pytest.approx(10 / 3)
