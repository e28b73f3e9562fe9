"""The router's routing table (routing.json): what it accepts, what it refuses and in
what words, and which bucket a prompt length falls in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.protocol import routing
from pdserve.protocol.routing import RoutingFileError, parse_table

TABLE: dict[str, Any] = {
    "pool": "tiny",
    "model": {"name": "tiny-llama", "path": "/models/tiny-llama", "maxModelLen": None},
    "buckets": [
        {"maxInputTokens": 512, "mode": "colocated"},
        {"maxInputTokens": None, "mode": "disaggregated"},
    ],
    "kvTransfer": {"failurePolicy": "recompute"},
    "slo": {"ttftSeconds": 2.0},
    "discovery": {
        "kind": "static",
        "decode": ["http://127.0.0.1:8001"],
        "prefill": ["http://127.0.0.1:8002/"],
    },
}


def with_changes(**changes: Any) -> bytes:
    return json.dumps({**TABLE, **changes}).encode()


def test_a_prompt_takes_the_first_bucket_that_holds_it() -> None:
    table = parse_table(with_changes())
    assert [table.bucket_of(n) for n in (1, 512, 513, 100_000)] == [0, 0, 1, 1]
    assert [table.bucket_label(i) for i in (0, 1)] == ["le512", "gt512"]
    assert table.discovery.prefill == ("http://127.0.0.1:8002",)  # type: ignore[union-attr]
    one = parse_table(with_changes(buckets=[{"mode": "colocated"}]))
    assert one.bucket_label(one.bucket_of(10**6)) == "all"


@pytest.mark.parametrize(
    ("buckets", "bound"),
    [
        ([(512, "colocated"), (None, "disaggregated")], 512),
        ([(128, "colocated"), (512, "colocated"), (None, "disaggregated")], 512),
        ([(512, "disaggregated"), (None, "colocated")], 0),
        ([(64, "colocated"), (512, "disaggregated"), (None, "colocated")], 64),
    ],
)
def test_the_colocated_bound_is_where_the_first_disaggregated_bucket_starts(
    buckets: list[tuple[int | None, str]], bound: int
) -> None:
    rows = [{"maxInputTokens": most, "mode": mode} for most, mode in buckets]
    assert parse_table(with_changes(buckets=rows)).colocated_up_to() == bound


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "must hold a JSON object"),
        (with_changes(buckets=[]), "buckets"),
        (
            with_changes(buckets=[{"mode": "colocated"}, {"mode": "disaggregated"}]),
            "only the last bucket may omit maxInputTokens",
        ),
        (
            with_changes(
                buckets=[
                    {"maxInputTokens": 512, "mode": "colocated"},
                    {"maxInputTokens": 256, "mode": "disaggregated"},
                ]
            ),
            "strictly ascending",
        ),
        (with_changes(buckets=[{"mode": "both"}]), "buckets.0.mode"),
        (
            with_changes(discovery={"kind": "static", "decode": ["http://127.0.0.1:1"]}),
            "a disaggregated bucket needs prefill workers",
        ),
        (
            with_changes(discovery={"kind": "static", "decode": ["ftp://host:1"]}),
            "not a worker URL",
        ),
        (with_changes(discovery={"kind": "dns"}), "discovery"),
        (with_changes(model={"name": "x"}), "model.path"),
        (with_changes(bucket=[]), "bucket: Extra inputs are not permitted"),
    ],
)
def test_a_malformed_table_is_refused_naming_the_problem(data: bytes, words: str) -> None:
    with pytest.raises(RoutingFileError, match=r"routing\.json") as refused:
        parse_table(data)
    assert words in str(refused.value)


def test_the_published_routing_schema_is_up_to_date() -> None:
    published = Path(__file__).resolve().parents[2] / "docs" / "routing.schema.json"
    assert published.read_text() == routing.json_schema(), "run `make crd`"
