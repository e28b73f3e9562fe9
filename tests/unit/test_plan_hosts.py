"""Workers that share a machine's cores: a step is stretched by the contention while
it runs (the other workers stepping, the router's and the clients' CPU), on a host
the pool's workers share; a worker alone, or on a node of its own, steps at the
profile's pace. And the contention model's slope, fitted to measured slowdowns."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.operator import api
from pdserve.operator.planning.candidates import Candidate
from pdserve.operator.planning.simulator import scenario_line as plan_scenario_line
from pdserve.workers.bench.plan import PlannedRequest
from pdserve.workers.plan.contention import fit_slope, levels
from pdserve.workers.plan.costs import ClientCost, Contention, Profile
from pdserve.workers.plan.hosts import CLIENT_WINDOW_S, PLACEMENTS
from pdserve.workers.plan.pool import PoolSimulation, Traffic
from pdserve.workers.plan.scenario import parse_scenario
from support.plan import constant_profile, model_config_dir, scenario_line

STEP_S, SLOPE, CORES = 0.01, 0.6, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_config_dir(tmp_path_factory.mktemp("model"))


def two_core_profile(model_dir: Path, clients: ClientCost | None = None) -> Profile:
    """Steps of STEP_S alone, on a 2-core machine whose contention slope is SLOPE."""
    profile: Profile = constant_profile(model_dir, STEP_S).model_copy(
        update={"cores": CORES, "contention": Contention(slope=SLOPE),
                "clients": clients or ClientCost()}
    )  # fmt: skip
    return profile


def first_token_times(
    profile: Profile, placement: str, num_decode: int, requests: int
) -> list[float]:
    """Each request's TTFT: `requests` one-token prompts at once, one per worker."""
    line = scenario_line("hosts", [], num_decode=num_decode, placement=placement)
    plan = [PlannedRequest(i, 0.0, 16, 1, "t") for i in range(requests)]
    simulation = PoolSimulation(parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None))
    records = simulation.run()
    assert all(record.finished for record in records)
    return sorted(record.chunk_times[0] - (record.sent_at or 0.0) for record in records)


def test_one_worker_alone_on_a_shared_host_steps_at_the_profiles_pace(model_dir: Path) -> None:
    assert first_token_times(two_core_profile(model_dir), "one-host", 1, 1) == [STEP_S]


def test_workers_on_nodes_of_their_own_do_not_slow_each_other(model_dir: Path) -> None:
    times = first_token_times(two_core_profile(model_dir), "node-per-worker", 2, 2)
    assert times == [STEP_S, STEP_S]


def test_two_busy_workers_on_a_two_core_host_slow_each_other_down(model_dir: Path) -> None:
    times = first_token_times(two_core_profile(model_dir), "one-host", 2, 2)
    # Both steps run together from the start: two busy threads on two cores.
    assert times == [pytest.approx(STEP_S * (1 + SLOPE * 1 / CORES))] * 2


def test_a_step_goes_faster_once_the_step_beside_it_ends(model_dir: Path) -> None:
    # One request of one token, one of two: the one-token worker's step ends while
    # the other's second step is under way, which then runs alone.
    profile = two_core_profile(model_dir)
    line = scenario_line("hosts", [], num_decode=2, placement="one-host")
    plan = [PlannedRequest(0, 0.0, 16, 2, "t"), PlannedRequest(1, 0.0, 16, 1, "t")]
    simulation = PoolSimulation(parse_scenario(line), profile, Traffic(plan, 0, 256, 60.0, None))
    two, one = simulation.run()
    shared = STEP_S * (1 + SLOPE / CORES)
    assert one.chunk_times == [pytest.approx(shared)]
    assert two.chunk_times == [pytest.approx(shared), pytest.approx(shared + STEP_S)]


def test_a_profile_without_the_machines_cores_models_no_sharing(model_dir: Path) -> None:
    profile = two_core_profile(model_dir).model_copy(update={"cores": None})
    assert first_token_times(profile, "one-host", 2, 2) == [STEP_S, STEP_S]


def test_the_router_and_clients_cpu_takes_the_shared_hosts_cores(model_dir: Path) -> None:
    clients = ClientCost(per_request_s=0.5, per_token_s=0.0)
    profile = two_core_profile(model_dir, clients)
    busy = 0.5 / CLIENT_WINDOW_S  # threads the request's arrival keeps busy
    alone = first_token_times(profile, "one-host", 1, 1)
    assert alone == [pytest.approx(STEP_S * (1 + SLOPE * busy / CORES))]
    assert first_token_times(profile, "node-per-worker", 1, 1) == [STEP_S]


def test_more_busy_threads_than_cores_share_them_out() -> None:
    flat = Contention(slope=0.0)
    assert flat.stretch(demand=1, own=1, cores=2) == 1.0
    assert flat.stretch(demand=3, own=1, cores=2) == 1.5  # three threads on two cores
    assert Contention(slope=SLOPE).stretch(demand=2, own=1, cores=2) == 1 + SLOPE / 2


def test_the_fitted_slope_reproduces_the_measured_slowdowns() -> None:
    truth = Contention(slope=0.8)
    samples = [(n, truth.stretch(n * 1.0, 1.0, CORES)) for n in levels(CORES, threads=1)]
    assert [n for n, _ in samples] == [1, 2, 3]  # one more worker than the cores hold
    assert fit_slope(samples, CORES, threads=1) == pytest.approx(0.8)
    assert fit_slope([(1, 1.0), (2, 0.9)], CORES, threads=1) == 0.0  # never negative


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_plan_places_workers_a_node_each_unless_told_one_host(placement: str) -> None:
    manifest = {
        "apiVersion": "pdserve.dev/v1alpha1", "kind": "ServingPool", "metadata": {"name": "p"},
        "spec": {"model": {"name": "m", "path": "/models/m"}},
    }  # fmt: skip
    candidate = Candidate("colocated", 0, 2, "", None, api.parse_pool(manifest).spec)
    default = parse_scenario(plan_scenario_line("p", candidate, (50,), (256,)))
    assert default.placement == "node-per-worker"
    told = parse_scenario(plan_scenario_line("p", candidate, (50,), (256,), placement))
    assert told.placement == placement
