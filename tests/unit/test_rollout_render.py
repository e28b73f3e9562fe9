"""Rendering a canary rollout: a role's revisions as Deployments, their workers, the
router's split, and the replace strategy left exactly as it was."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from pdserve.operator import api, render
from pdserve.operator.controller import status as pool_status
from pdserve.operator.rollout import changes, handover
from pdserve.protocol import routing
from support.pools import example, merged

Obj = dict[str, Any]
NOW = datetime(2026, 1, 1, tzinfo=UTC)
NS = "serving"
STEPS = [{"weight": 25, "analysisSeconds": 60}, {"weight": 50, "workers": 75}]
CANARY = {"type": "canary", "steps": STEPS}


def spec_of(**decode: Any) -> api.ServingPoolSpec:
    patch = {"spec": {"decode": {"replicas": 4, "rollout": CANARY, **decode}}}
    return api.parse_pool(merged(example("tiny-colocated"), patch)).spec


def deployments(objects: list[Obj]) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def workers(objects: list[Obj]) -> list[Obj]:
    return [d for name, d in deployments(objects).items() if name != "tiny-router"]


def args(deployment: Obj) -> list[str]:
    found: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return found


def flag(deployment: Obj, name: str) -> str:
    values = args(deployment)
    return values[values.index(name) + 1]


def table(objects: list[Obj]) -> routing.RoutingTable:
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return routing.parse_table(config["data"][render.ROUTING_FILE].encode())


def revision(spec: api.ServingPoolSpec) -> str:
    return render.worker_revision("tiny", NS, spec, "decode")


def changed(old: api.ServingPoolSpec, new: api.ServingPoolSpec) -> api.RolloutStatus:
    """The rollout a change from `old` to `new` starts (as the reconciler computes it)."""
    first = changes.pool_change(old, None, {"decode": revision(old)}, NOW)
    started = changes.pool_change(new, first, {"decode": revision(new)}, NOW)
    assert started is not None
    return started


def test_replace_renders_exactly_what_it_did_without_rollouts() -> None:
    spec = api.parse_pool(example("tiny-colocated")).spec
    stale = changed(spec_of(), spec_of(engine={"maxNumBatchedTokens": 512}))
    plain = render.render("tiny", NS, spec)
    assert render.render("tiny", NS, spec, rollout=stale, live={}) == plain
    (deployment,) = workers(plain)
    assert deployment["metadata"]["name"] == "tiny-decode"
    assert render.REVISION_LABEL not in deployment["spec"]["selector"]["matchLabels"]
    assert "--revision" not in args(deployment)
    assert table(plain).revisions == routing.Revisions()


def test_a_canary_role_runs_its_revision_under_its_name() -> None:
    spec = spec_of()
    name = revision(spec)
    assert name.startswith("decode-") and len(name) == len("decode-") + 10
    objects = render.render("tiny", NS, spec)
    (deployment,) = workers(objects)
    assert deployment["metadata"]["name"] == f"tiny-{name}"
    assert deployment["spec"]["replicas"] == 4
    assert deployment["spec"]["selector"]["matchLabels"][render.REVISION_LABEL] == name
    assert deployment["spec"]["template"]["metadata"]["labels"][render.REVISION_LABEL] == name
    assert flag(deployment, "--revision") == name
    # The Service and the disruption budget select the role: every revision.
    service = next(
        o for o in objects if o["kind"] == "Service" and "decode" in o["metadata"]["name"]
    )
    assert render.REVISION_LABEL not in service["spec"]["selector"]
    assert table(objects).revisions == routing.Revisions()


def test_revision_follows_what_workers_run_not_how_many() -> None:
    base = revision(spec_of())
    assert revision(spec_of(replicas=9)) == base
    assert revision(spec_of(engine={"maxNumBatchedTokens": 512})) != base
    image = spec_of().model_copy(update={"image": "pdserve:0.2.0"})
    assert revision(image) != base


def test_a_rollout_in_progress_renders_both_revisions_and_the_split() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    stable, canary = revision(old), revision(new)
    rollout = changed(old, new)
    status = rollout.decode
    assert status is not None and status.phase == "Progressing"
    assert (status.stable_revision, status.canary_revision, status.weight) == (stable, canary, 25)
    live = deployments(render.render("tiny", NS, old))
    objects = render.render("tiny", NS, new, rollout=rollout, live=live)
    found = deployments(objects)
    assert set(found) == {f"tiny-{stable}", f"tiny-{canary}", "tiny-router"}
    # Step 1: 25% of 4 workers, rounded up, run the canary; the stable revision keeps
    # the pod template it runs (its old budget) with the rest.
    assert found[f"tiny-{stable}"]["spec"]["replicas"] == 3
    assert flag(found[f"tiny-{stable}"], "--max-num-batched-tokens") == "256"
    assert flag(found[f"tiny-{stable}"], "--revision") == stable
    assert found[f"tiny-{canary}"]["spec"]["replicas"] == 1
    assert flag(found[f"tiny-{canary}"], "--max-num-batched-tokens") == "512"
    assert flag(found[f"tiny-{canary}"], "--revision") == canary
    assert table(objects).revisions.decode == (
        routing.RevisionWeight(name=stable, weight=75),
        routing.RevisionWeight(name=canary, weight=25),
    )
    # The split reaches the routers from their file: they are not restarted for it.
    router = found["tiny-router"]["spec"]["template"]["metadata"]["annotations"]
    before = deployments(render.render("tiny", NS, new))["tiny-router"]
    assert router == before["spec"]["template"]["metadata"]["annotations"]


def test_the_second_step_takes_its_workers_share() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    rollout = changed(old, new)
    assert rollout.decode is not None
    second = rollout.model_copy(
        update={"decode": rollout.decode.model_copy(update={"step": 1, "weight": 50})}
    )
    live = deployments(render.render("tiny", NS, old))
    found = deployments(render.render("tiny", NS, new, rollout=second, live=live))
    counts = {name: d["spec"]["replicas"] for name, d in found.items() if name != "tiny-router"}
    assert counts == {f"tiny-{revision(old)}": 1, f"tiny-{revision(new)}": 3}  # workers: 75%


def test_a_rolled_back_role_runs_the_stable_revision_alone() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    rollout = changed(old, new)
    assert rollout.decode is not None
    ended = rollout.model_copy(
        update={"decode": rollout.decode.model_copy(update={"phase": "RolledBack", "weight": 0})}
    )
    live = deployments(render.render("tiny", NS, old))
    objects = render.render("tiny", NS, new, rollout=ended, live=live)
    found = deployments(objects)
    assert set(found) == {f"tiny-{revision(old)}", "tiny-router"}
    assert found[f"tiny-{revision(old)}"]["spec"]["replicas"] == 4
    assert flag(found[f"tiny-{revision(old)}"], "--max-num-batched-tokens") == "256"
    assert table(objects).revisions == routing.Revisions()
    # The spec still asks for the refused revision: nothing starts again.
    again = changes.pool_change(new, ended, {"decode": revision(new)}, NOW)
    assert again is not None and again.decode == ended.decode
    assert again.phase == "RolledBack"  # what `kubectl get` shows


def test_a_newer_change_replaces_the_canary_and_starts_over() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    newer = spec_of(engine={"maxNumBatchedTokens": 1024})
    rollout = changed(old, new)
    assert rollout.decode is not None
    later = rollout.model_copy(update={"decode": rollout.decode.model_copy(update={"step": 1})})
    restarted = changes.pool_change(newer, later, {"decode": revision(newer)}, NOW)
    assert restarted is not None and restarted.decode is not None
    decode = restarted.decode
    assert (decode.stable_revision, decode.canary_revision) == (revision(old), revision(newer))
    assert (decode.step, decode.weight, decode.phase) == (0, 25, "Progressing")
    assert decode.last_decision is not None and revision(new) in decode.last_decision.message


def test_the_spec_back_at_the_stable_revision_ends_the_rollout() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    reverted = changes.pool_change(old, changed(old, new), {"decode": revision(old)}, NOW)
    assert reverted is not None and reverted.decode is not None
    assert reverted.decode.phase == "Aborted" and reverted.phase == "Aborted"
    assert reverted.decode.last_decision is not None
    assert reverted.decode.last_decision.reason == "Reverted"


def test_a_new_canary_role_has_no_rollout_phase_to_show() -> None:
    adopted = changes.pool_change(spec_of(), None, {"decode": revision(spec_of())}, NOW)
    assert adopted is not None and adopted.phase is None
    assert adopted.decode is not None and adopted.decode.stable_revision == revision(spec_of())
    # A role switched back to replace forgets its rollouts.
    replace = api.parse_pool(example("tiny-colocated")).spec
    assert changes.pool_change(replace, adopted, {}, NOW) is None


def test_routing_table_refuses_weights_that_do_not_add_up() -> None:
    with pytest.raises(ValueError, match="add up to 100"):
        routing.Revisions.model_validate(
            {"decode": [{"name": "a", "weight": 60}, {"name": "b", "weight": 30}]}
        )


# --- handing over without an outage -----------------------------------------------------


def live_deployment(obj: Obj, ready: int) -> Obj:
    replicas = obj["spec"].get("replicas", 1)
    status = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": ready,
              "readyReplicas": ready}  # fmt: skip
    return {**obj, "metadata": {**obj["metadata"], "generation": 1}, "status": status}


def test_a_completed_rollout_keeps_the_old_revision_until_the_new_one_is_ready() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    rollout = changed(old, new)
    assert rollout.decode is not None
    done = rollout.model_copy(
        update={"decode": rollout.decode.model_copy(
            update={"phase": "Completed", "stable_revision": revision(new), "canary_revision": None,
                    "weight": 100},
        )}
    )  # fmt: skip
    desired = render.render("tiny", NS, new, rollout=done)
    old_live = live_deployment(
        deployments(render.render("tiny", NS, old))[f"tiny-{revision(old)}"], 3
    )
    new_live = live_deployment(deployments(desired)[f"tiny-{revision(new)}"], 1)
    kept = handover.kept_deployments(new, done, desired, [old_live, new_live])
    assert kept == {f"tiny-{revision(old)}"}
    new_ready = live_deployment(deployments(desired)[f"tiny-{revision(new)}"], 4)
    assert handover.kept_deployments(new, done, desired, [old_live, new_ready]) == set()


def test_a_refused_canary_goes_at_once() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    rollout = changed(old, new)
    assert rollout.decode is not None
    aborted = rollout.model_copy(
        update={"decode": rollout.decode.model_copy(update={"phase": "Aborted"})}
    )
    both = deployments(
        render.render(
            "tiny", NS, new, rollout=rollout, live=deployments(render.render("tiny", NS, old))
        )
    )
    desired = render.render("tiny", NS, new, rollout=aborted, live=both)
    live = [
        live_deployment(both[f"tiny-{revision(old)}"], 3),
        live_deployment(both[f"tiny-{revision(new)}"], 1),
    ]
    assert handover.kept_deployments(new, aborted, desired, live) == set()


def test_switching_replace_to_canary_keeps_the_old_deployment_until_ready() -> None:
    replace = api.parse_pool(
        merged(example("tiny-colocated"), {"spec": {"decode": {"replicas": 4}}})
    ).spec
    legacy = live_deployment(deployments(render.render("tiny", NS, replace))["tiny-decode"], 4)
    canary = spec_of()
    desired = render.render("tiny", NS, canary)
    fresh = live_deployment(deployments(desired)[f"tiny-{revision(canary)}"], 0)
    assert handover.kept_deployments(canary, None, desired, [legacy, fresh]) == {"tiny-decode"}
    ready = live_deployment(deployments(desired)[f"tiny-{revision(canary)}"], 4)
    assert handover.kept_deployments(canary, None, desired, [legacy, ready]) == set()


def test_status_counts_a_role_over_its_revisions() -> None:
    old, new = spec_of(), spec_of(engine={"maxNumBatchedTokens": 512})
    rollout = changed(old, new)
    desired = render.render(
        "tiny", NS, new, rollout=rollout, live=deployments(render.render("tiny", NS, old))
    )
    live = {
        name: live_deployment(obj, obj["spec"]["replicas"])
        for name, obj in deployments(desired).items()
    }
    status = pool_status.pool_status(
        api.ServingPoolStatus(), pool="tiny", namespace=NS, generation=1, spec=new,
        deployments=live, expected=handover.expected_counts(desired),
    )  # fmt: skip
    assert status.decode == api.RoleStatus(desired_replicas=4, ready_replicas=4)
    assert status.phase == "Ready"
    assert json.dumps(api.dump(status))  # serialisable as the status patch


def test_an_autoscaler_scales_the_stable_revision() -> None:
    hpa = {"enabled": True, "policy": {"type": "hpa"}}
    patch = {"spec": {"decode": {"replicas": 4, "rollout": CANARY}, "autoscaling": hpa,
                      "slo": {"ttft": {"seconds": 1}, "itl": {"seconds": 0.1}}}}  # fmt: skip
    old = api.parse_pool(merged(example("tiny-colocated"), patch)).spec
    new = old.model_copy(update={"image": "pdserve:0.2.0"})

    def target(objects: list[Obj]) -> str:
        (scaler,) = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
        name: str = scaler["spec"]["scaleTargetRef"]["name"]
        return name

    assert target(render.render("tiny", NS, old)) == f"tiny-{revision(old)}"
    rollout = changed(old, new)
    live = deployments(render.render("tiny", NS, old))
    objects = render.render("tiny", NS, new, rollout=rollout, live=live)
    assert target(objects) == f"tiny-{revision(old)}"
    found = deployments(objects)
    assert "replicas" not in found[f"tiny-{revision(old)}"]["spec"]  # the HPA's
    assert found[f"tiny-{revision(new)}"]["spec"]["replicas"] == 1  # 25% of the spec's 4
