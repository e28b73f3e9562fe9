"""Telling whether a live child still is what the operator applied (drift.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.operator import api, render
from pdserve.operator.controller import drift, kube
from pdserve.operator.controller.reconcile import desired_objects, owned_by

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
UID = "4a1c2f6e-0000-4000-8000-000000000001"

Obj = dict[str, Any]


def pool(path: Path = ROOT / "deploy" / "examples" / "disaggregated.yaml") -> Obj:
    manifest: Obj = yaml.safe_load(path.read_text())
    manifest["metadata"].update(namespace="serving", uid=UID, generation=1)
    return manifest


def desired(manifest: Obj | None = None) -> dict[tuple[str, str], Obj]:
    manifest = manifest or pool()
    return desired_objects(manifest, api.parse_spec(manifest["spec"]))


def served(obj: Obj) -> Obj:
    """The object as the API server gives it back: defaults, status and server metadata
    added, false/empty values dropped, quantities in canonical form."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="u-1", resourceVersion="42", managedFields=[{"manager": "x"}])
    if live["kind"] == "Service":
        live["spec"].pop("publishNotReadyAddresses", None)
        live["spec"].update(sessionAffinity="None", ipFamilies=["IPv4"])
    if live["kind"] == "Deployment":
        live["spec"].update(progressDeadlineSeconds=600, revisionHistoryLimit=10)
        pod = live["spec"]["template"]["spec"]
        pod["dnsPolicy"] = "ClusterFirst"
        for container in pod["containers"]:
            container["terminationMessagePath"] = "/dev/termination-log"
            limits = container.get("resources", {}).get("limits", {})
            for name, value in limits.items():
                limits[name] = str(value)  # 1 -> "1"
            for var in container["env"]:
                if "fieldRef" in var.get("valueFrom", {}):
                    var["valueFrom"]["fieldRef"]["apiVersion"] = "v1"
        live["status"] = {"replicas": live["spec"]["replicas"]}
    return live


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_child_is_owned_stamped_and_of_a_kind_the_operator_writes(example: Path) -> None:
    for key, obj in desired(pool(example)).items():
        assert owned_by(obj, UID), key
        assert obj["metadata"]["annotations"][drift.HASH_ANNOTATION]
        assert kube.kind_of(obj).api_version == obj["apiVersion"]


def test_what_the_server_adds_is_not_drift() -> None:
    for key, want in desired().items():
        assert drift.up_to_date(want, served(want)), key


def test_the_hash_follows_content_not_key_order() -> None:
    obj = render.pod_disruption_budget("p", "ns", "decode")
    reordered = {k: obj[k] for k in reversed(list(obj))}
    assert drift.content_hash(obj) == drift.content_hash(reordered)
    changed = copy.deepcopy(obj)
    changed["spec"]["maxUnavailable"] = 2
    assert drift.content_hash(changed) != drift.content_hash(obj)
    assert drift.HASH_ANNOTATION not in obj["metadata"].get("annotations", {})


def test_a_field_removed_from_the_spec_is_caught_by_the_hash() -> None:
    # The live object still holds every value of the new rendering (it has one more
    # nodeSelector key); only the hash tells that an apply must remove that key.
    manifest = pool()
    old = desired(manifest)[("Deployment", "llama-pd-decode")]
    manifest["spec"]["decode"]["nodeSelector"] = {"gpu": "h100"}
    with_selector = desired(manifest)[("Deployment", "llama-pd-decode")]
    assert drift.up_to_date(with_selector, served(with_selector))
    assert not drift.up_to_date(old, served(with_selector))
    values_only = copy.deepcopy(old)
    del values_only["metadata"]["annotations"][drift.HASH_ANNOTATION]
    assert drift.holds(served(with_selector), values_only)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["spec"].update(replicas=9),
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(image="evil:1"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].append("--debug"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"].pop(),
        lambda d: d["metadata"]["labels"].pop(render.POOL_LABEL),
        lambda d: d["metadata"]["annotations"].pop(drift.HASH_ANNOTATION),
    ],
    ids=["replicas", "image", "extra-arg", "env-removed", "label-removed", "no-hash"],
)
def test_a_hand_edit_of_an_applied_field_is_drift(edit: Any) -> None:
    want = desired()[("Deployment", "llama-pd-decode")]
    live = served(want)
    edit(live)
    assert not drift.up_to_date(want, live)


def test_quantities_match_by_value_only_under_resources() -> None:
    assert drift.holds(
        {"resources": {"limits": {"cpu": "500m"}}}, {"resources": {"limits": {"cpu": "0.5"}}}
    )
    assert drift.holds(
        {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
        {"resources": {"limits": {"nvidia.com/gpu": 2}}},
    )
    assert not drift.holds(
        {"resources": {"limits": {"cpu": "2"}}}, {"resources": {"limits": {"cpu": "1"}}}
    )
    assert not drift.holds({"replicas": "2"}, {"replicas": 2})
    assert not drift.holds({"args": ["1k"]}, {"args": ["1000"]})


def test_zero_values_match_absent_ones_and_nothing_else() -> None:
    assert drift.holds({}, {"publishNotReadyAddresses": False, "volumes": [], "env": {}})
    assert not drift.holds({}, {"replicas": 1})
    assert not drift.holds({"flag": True}, {"flag": False})
