"""The router's split of a role's traffic between revisions: by the weights, the same
revision for every request of a conversation, and never a request failed for it."""

from __future__ import annotations

from collections import Counter

from pdserve.protocol.routing import Revisions, RevisionWeight, RoutingTable
from pdserve.workers.router.revisions import RevisionSplit, conversation_point
from pdserve.workers.router.workers import WorkerSet

TABLE = RoutingTable.model_validate(
    {
        "pool": "p",
        "model": {"name": "m", "path": "/m"},
        "buckets": [{"mode": "colocated"}],
        "discovery": {"kind": "static", "decode": ["http://a"]},
    }
)


def table(stable: int) -> RoutingTable:
    weights = (
        RevisionWeight(name="old", weight=stable),
        RevisionWeight(name="new", weight=100 - stable),
    )
    return TABLE.model_copy(update={"revisions": Revisions(decode=weights)})


def workers(**revisions: str | None) -> WorkerSet:
    """Decode workers at http://NAME running the given revisions."""
    found = WorkerSet("decode")
    found.update(f"http://{name}" for name in revisions)
    for worker in found:
        worker.revision = revisions[worker.url.removeprefix("http://")]
    return found


def prompt(i: int) -> list[int]:
    return [i, i + 1, i + 2] * 10


def test_no_revisions_in_the_table_split_nothing() -> None:
    assert RevisionSplit.of(TABLE, prompt(1), None) is None


def test_requests_split_by_the_weights() -> None:
    pool = workers(a="old", b="new")
    served: Counter[str] = Counter()
    for i in range(2000):
        split = RevisionSplit.of(table(75), prompt(i), None)
        assert split is not None
        (allowed,) = {w.url for w in pool} - split.outside(pool, set())
        served[allowed] += 1
    assert 0.70 < served["http://a"] / 2000 < 0.80


def test_a_conversation_stays_on_its_revision_and_a_growing_canary_only_takes_over() -> None:
    points = [conversation_point(prompt(i)[:16], None) for i in range(500)]
    for point in points:
        assert point == conversation_point(prompt(points.index(point))[:16], None)
    # The same user, whatever the prompt.
    assert conversation_point([1, 2], "alice") == conversation_point([9, 9], "alice")
    previous = {i: "old" for i in range(500)}
    for stable in (90, 75, 50, 10):
        for i in range(500):
            split = RevisionSplit.of(table(stable), prompt(i), None)
            assert split is not None
            wanted = split.wanted("decode")
            assert not (previous[i] == "new" and wanted == "old")
            previous[i] = wanted or ""


def test_a_revision_with_no_live_worker_falls_back_to_the_other() -> None:
    pool = workers(a="old", b="new")
    split = RevisionSplit.of(table(0), prompt(1), None)
    assert split is not None and split.wanted("decode") == "new"
    assert split.outside(pool, set()) == {"http://a"}
    assert split.outside(pool, {"http://b"}) == {"http://b"}  # tried: the stable one then
    pool.get("http://b").breaker.failed()  # type: ignore[union-attr]
    for _ in range(10):
        pool.get("http://b").breaker.failed()  # type: ignore[union-attr]
    assert split.outside(pool, set()) == {"http://b"}


def test_workers_of_no_named_revision_serve_only_when_no_named_one_can() -> None:
    pool = workers(a="old", b=None)
    split = RevisionSplit.of(table(50), prompt(3), None)
    assert split is not None
    assert split.outside(pool, set()) == {"http://b"}
    assert split.outside(pool, {"http://a"}) == set()
