"""A pool's children's watch events are handled by one task per pool, each child's
newest event once, without the watch handler waiting for the pool."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.operator.controller.cache import PoolKey
from pdserve.operator.controller.child_events import Changed, ChildEvents

POOL: PoolKey = ("ns", "pool")


def child(kind: str, name: str, version: str = "1") -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name, "resourceVersion": version}}


class Recorder:
    """Records what each call got; the first call waits until released."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str, str]]] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def handle(self, pool: PoolKey, changed: Changed) -> None:
        assert pool == POOL
        self.started.set()
        await self.release.wait()
        self.calls.append(
            [(event, body["metadata"]["name"], body["metadata"]["resourceVersion"])
             for event, body in changed.values()]
        )  # fmt: skip


async def settle(events: ChildEvents) -> None:
    while events.pending() or events._drains:
        await asyncio.sleep(0)


async def test_events_while_the_pool_is_busy_coalesce_to_each_childs_newest() -> None:
    recorder = Recorder()
    events = ChildEvents(recorder.handle)
    events.note(POOL, "ADDED", child("Deployment", "a"))
    await recorder.started.wait()  # the first batch is being handled: the pool is busy
    events.note(POOL, "MODIFIED", child("Deployment", "b", "2"))
    events.note(POOL, "MODIFIED", child("Service", "c", "3"))
    events.note(POOL, "MODIFIED", child("Deployment", "b", "4"))
    events.note(POOL, "DELETED", child("Service", "c", "5"))
    assert events.pending() == 2
    recorder.release.set()
    await settle(events)
    assert recorder.calls == [
        [("ADDED", "a", "1")],
        [("MODIFIED", "b", "4"), ("DELETED", "c", "5")],
    ]


async def test_a_failure_is_logged_and_later_events_are_still_handled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handled: list[str] = []

    async def handle(pool: PoolKey, changed: Changed) -> None:
        for _, body in changed.values():
            if body["metadata"]["name"] == "bad":
                raise RuntimeError("boom")
            handled.append(body["metadata"]["name"])

    events = ChildEvents(handle)
    events.note(POOL, "MODIFIED", child("Pod", "bad"))
    await settle(events)
    events.note(POOL, "MODIFIED", child("Pod", "good"))
    await settle(events)
    assert handled == ["good"]
    assert "boom" in caplog.text


async def test_close_stops_the_pools_tasks() -> None:
    recorder = Recorder()
    events = ChildEvents(recorder.handle)
    events.note(POOL, "ADDED", child("Deployment", "a"))
    await recorder.started.wait()
    await events.close()
    assert not events._drains and events.pending() == 0 and recorder.calls == []
