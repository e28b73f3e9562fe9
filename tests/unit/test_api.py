"""The ServingPool API models: examples accepted, every invalid pool refused by name."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.operator import api
from support.pools import INVALID_CASES, example, merged

CASES = INVALID_CASES


def test_examples_are_valid() -> None:
    tiny = api.parse_pool(example("tiny-colocated"))
    assert tiny.metadata.name == "tiny"
    assert tiny.spec.prefill is None
    assert tiny.spec.worker_role("decode") == "both"
    pd = api.parse_pool(example("disaggregated"))
    assert pd.spec.routing.disaggregated
    assert pd.spec.worker_role("decode") == "decode"
    assert pd.spec.kv_transfer.backend == "nixl"
    assert pd.spec.prefill is not None and pd.spec.prefill.gpus == 1


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_invalid_pool_is_refused_naming_the_field(case: dict[str, Any]) -> None:
    manifest = merged(example(case["base"]), case["patch"])
    with pytest.raises(api.InvalidPoolError) as refused:
        api.parse_pool(manifest)
    lines = refused.value.errors
    assert any(case["field"] in line and case["message"] in line for line in lines), lines


def test_errors_start_with_the_field_path() -> None:
    manifest = merged(example("tiny-colocated"), {"spec": {"decode": {"replicas": -1}}})
    with pytest.raises(api.InvalidPoolError) as refused:
        api.parse_pool(manifest)
    assert refused.value.errors == (
        "spec.decode.replicas: Input should be greater than or equal to 0",
    )
    assert "spec.decode.replicas" in str(refused.value)


def test_cross_field_errors_share_the_cel_rule_message() -> None:
    spec = example("tiny-colocated")["spec"]
    spec["routing"] = {
        "buckets": [{"maxInputTokens": 8, "mode": "disaggregated"}, {"mode": "colocated"}]
    }
    with pytest.raises(api.InvalidPoolError) as refused:
        api.parse_spec(spec)
    assert refused.value.errors == (f"spec.routing: {api.DISAGGREGATED_NEEDS_PREFILL.message}",)


def test_unknown_field_is_refused_locally() -> None:
    # The API server prunes unknown fields; locally a typo must not pass unnoticed.
    manifest = merged(example("tiny-colocated"), {"spec": {"decode": {"replica": 3}}})
    with pytest.raises(api.InvalidPoolError, match=r"spec\.decode\.replica: Extra inputs"):
        api.parse_pool(manifest)


def test_snake_case_keys_are_refused_in_manifests() -> None:
    # Python code may say max_num_seqs; a manifest must say maxNumSeqs, as on a cluster.
    manifest = merged(
        example("tiny-colocated"), {"spec": {"decode": {"engine": {"max_num_seqs": 4}}}}
    )
    with pytest.raises(api.InvalidPoolError, match=r"spec\.decode\.engine\.max_num_seqs"):
        api.parse_pool(manifest)
    assert api.EngineSettings(max_num_seqs=4).max_num_seqs == 4


def test_bad_quantity_names_the_resource() -> None:
    manifest = merged(
        example("tiny-colocated"),
        {"spec": {"decode": {"resources": {"limits": {"cpu": "2 cores"}}}}},
    )
    with pytest.raises(api.InvalidPoolError) as refused:
        api.parse_pool(manifest)
    assert refused.value.errors == (
        "spec.decode.resources.limits.cpu: '2 cores' should match a Kubernetes quantity "
        "such as 4Gi or 500m",
    )


def test_minimal_spec_gets_defaults() -> None:
    spec = api.parse_spec({"model": {"name": "m", "path": "/m"}, "image": "pdserve:1"})
    assert spec.decode.replicas == 1
    assert spec.prefill is None
    assert [b.mode for b in spec.routing.buckets] == ["colocated"]
    assert spec.routing.buckets[0].max_input_tokens is None
    assert spec.kv_transfer.failure_policy == "recompute"
    assert spec.decode.engine.max_num_batched_tokens == 2048
    assert not spec.autoscaling.enabled


def test_a_pool_without_image_takes_the_operators_default() -> None:
    spec = api.parse_spec({"model": {"name": "m", "path": "/m"}})
    assert spec.image is None
    assert api.with_image(spec, "registry.example/pdserve:2").image == "registry.example/pdserve:2"
    named = api.parse_spec({"model": {"name": "m", "path": "/m"}, "image": "pdserve:1"})
    assert api.with_image(named, "registry.example/pdserve:2").image == "pdserve:1"
    with pytest.raises(api.InvalidPoolError) as refused:
        api.with_image(spec, None)
    assert refused.value.errors == ("spec.image: required (the operator has no --default-image)",)


def test_manifest_round_trip_is_camel_case() -> None:
    pool = api.parse_pool(example("disaggregated"))
    dumped = api.dump(pool)
    assert dumped["spec"]["kvTransfer"]["failurePolicy"] == "recompute"
    assert dumped["spec"]["decode"]["engine"]["maxNumBatchedTokens"] == 512
    assert "max_num_seqs" not in str(dumped)
    assert api.parse_pool(dumped) == pool


def test_models_are_immutable() -> None:
    spec = api.parse_pool(example("tiny-colocated")).spec
    with pytest.raises(ValidationError):
        setattr(spec.decode, "replicas", 5)  # noqa: B010 (a plain assignment is a type error)


def test_role_status_summary_is_ready_over_desired() -> None:
    status = api.ServingPoolStatus.model_validate(
        {"decode": {"desiredReplicas": 3, "readyReplicas": 1}, "phase": "Progressing"}
    )
    assert status.decode is not None and status.decode.summary == "1/3"
    assert api.RoleStatus(desired_replicas=2, ready_replicas=2).summary == "2/2"


def test_condition_transition_time_moves_only_on_status_change() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    first = api.with_condition((), "Ready", "False", "Waiting", "0/1 ready", generation=1, now=t0)
    same = api.with_condition(first, "Ready", "False", "Waiting", "0/2", now=t0 + timedelta(1))
    flipped = api.with_condition(same, "Ready", "True", "AllReady", now=t0 + timedelta(2))
    assert same[0].last_transition_time == t0
    assert same[0].message == "0/2"
    assert flipped[0].last_transition_time == t0 + timedelta(2)
    both = api.with_condition(flipped, "Degraded", "False", "Healthy", now=t0)
    assert [c.type for c in both] == ["Ready", "Degraded"]
    dumped = api.dump(api.ServingPoolStatus(conditions=both))
    assert dumped["conditions"][0]["lastTransitionTime"] == "2025-01-03T00:00:00Z"
