"""The demo's pool is the checked-in example a user can run with `pdserve local`."""

from __future__ import annotations

from pathlib import Path

from pdserve.cli.demo import BUCKET_BOUNDARY, demo_pool
from pdserve.operator import api
from support.pools import example


def test_the_demo_runs_the_checked_in_example() -> None:
    model_dir = Path("/somewhere/tiny-llama")
    pool = api.parse_pool(demo_pool(model_dir))
    checked_in = api.parse_pool(example("tiny-disaggregated"))
    assert pool.spec.model.path == str(model_dir)
    model = checked_in.spec.model.model_copy(update={"path": str(model_dir)})
    assert pool.spec == checked_in.spec.model_copy(update={"model": model})
    assert pool.metadata.name == checked_in.metadata.name
    first = pool.spec.routing.buckets[0]
    assert (first.max_input_tokens, first.mode) == (BUCKET_BOUNDARY, "colocated")
