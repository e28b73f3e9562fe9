"""Parts of the hand-off, one function or class each: the closed set of failure codes,
leases that outlive their deadline until released, what expires from peer state,
calls that wait for a thread no longer than their deadline, and HTTP answers from a
peer read with a deadline and a size limit."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from pdserve.protocol.sampling import SamplingParams
from pdserve.workers.engine.kv_cache import BlockPool, KVCacheManager
from pdserve.workers.engine.leases import LeaseBook, LeaseError
from pdserve.workers.engine.request import Request
from pdserve.workers.handoff import peer_http
from pdserve.workers.handoff.blocking import BlockingCalls
from pdserve.workers.handoff.errors import CODES, PEER_FAILED, HandoffError, known_code
from pdserve.workers.handoff.expiring import ExpiringMap
from pdserve.workers.handoff.peer_http import NoReply, post_json
from pdserve.workers.kv_transfer.base import TransferError
from support.fake_peer import silent_server
from support.network import serving


def test_only_known_codes_become_reasons() -> None:
    assert known_code("layout_mismatch") == "layout_mismatch"
    for foreign in ("x" * 500, "Layout_Mismatch", 409, None, ["no_blocks"]):
        assert known_code(foreign) == PEER_FAILED
    assert HandoffError("m", "made-up").code == PEER_FAILED
    assert all(HandoffError("m", code).code == code for code in CODES)


def leased(
    book: LeaseBook, manager: KVCacheManager, name: str, lease_s: float, margin_s: float
) -> Request:
    request = Request(name, list(range(40)), SamplingParams(max_tokens=1))
    assert manager.allocate(name, 40)
    book.hold(request, lease_s, margin_s)
    return request


def test_a_lease_past_its_deadline_keeps_its_blocks_until_released_or_held_out() -> None:
    manager = KVCacheManager(BlockPool(8), block_size=16)
    book = LeaseBook(manager)
    leased(book, manager, "expired", lease_s=-1.0, margin_s=60.0)
    leased(book, manager, "live", lease_s=60.0, margin_s=60.0)
    now = time.monotonic()

    assert book.expire(now) == []  # past the deadline, not past the hold
    assert manager.pool.num_free == 2
    assert book.num_expired == 1
    with pytest.raises(LeaseError):
        book.take("expired")  # cannot be adopted any more
    assert book.take("live").request_id == "live"
    assert book.next_deadline() == pytest.approx(now + 59.0, abs=1.0)

    released = book.expire(now + 61.0)  # the hold is over: freed without a word
    assert [r.request_id for r in released] == ["expired"]
    assert manager.pool.num_free == 5
    assert book.num_expired == 1  # counted once


def test_a_released_lease_frees_at_once() -> None:
    manager = KVCacheManager(BlockPool(8), block_size=16)
    book = LeaseBook(manager)
    leased(book, manager, "r", lease_s=-1.0, margin_s=60.0)
    assert book.release("r") is not None
    assert manager.pool.num_free == 8
    assert book.release("r") is None
    assert book.next_deadline() is None


def test_expiring_entries_go_after_their_time_and_beyond_the_size() -> None:
    now = [0.0]
    remembered: ExpiringMap[str, int] = ExpiringMap(5.0, 3, clock=lambda: now[0])
    for index, key in enumerate("abcd"):
        remembered.put(key, index)
    assert "a" not in remembered and len(remembered) == 3  # the oldest made room
    now[0] = 4.9
    assert remembered.get("d") == 3
    remembered.put("b", 10)  # renewed
    now[0] = 5.1
    assert len(remembered) == 1 and remembered.get("b") == 10
    now[0] = 11.0
    assert len(remembered) == 0


async def test_a_call_still_queued_at_its_deadline_is_withdrawn() -> None:
    calls = BlockingCalls(meet_threads=1, move_threads=1)
    holding, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold_the_thread(left: float) -> None:
        holding.set()
        release.wait(60)

    def queued(left: float) -> None:
        ran.append("queued")

    busy = asyncio.ensure_future(calls.meet(time.monotonic() + 60, hold_the_thread))
    while not holding.is_set():
        await asyncio.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(TransferError, match="no thread was free"):
        await calls.meet(started + 0.2, queued)
    # Withdrawn at its deadline, while the thread it queued for was still held: it
    # did not wait for the thread.
    assert time.monotonic() >= started + 0.2
    assert not busy.done() and not release.is_set()
    # The other pool was free all along.
    assert await calls.move(time.monotonic() + 5, lambda left: left > 0)
    release.set()
    await busy
    assert ran == []
    with pytest.raises(TransferError, match="deadline"):
        await calls.move(time.monotonic() - 1, queued)  # no time left: never runs
    assert ran == []
    calls.close()


@pytest.fixture
async def silent_url() -> AsyncIterator[str]:
    async with silent_server() as url:
        yield url


async def test_a_peer_that_never_answers_costs_the_deadline_and_a_spent_one_nothing(
    silent_url: str,
) -> None:
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        with pytest.raises(NoReply) as silent:
            await post_json(session, silent_url, {}, started + 0.3)
        # The silent peer never answers: the call ended by its own deadline, and not
        # before it.
        assert silent.value.timed_out
        assert time.monotonic() >= started + 0.3
        # No time left must not read as "no timeout" (aiohttp's meaning of 0).
        with pytest.raises(NoReply, match="no time left"):
            await post_json(session, silent_url, {}, time.monotonic())


@pytest.fixture
async def answering_url() -> AsyncIterator[str]:
    bodies = {
        "/big": (200, b'{"a": "' + b"x" * (peer_http.MAX_REPLY_BYTES + 10) + b'"}'),
        "/deep": (200, b"[" * 100_000),
        "/fine": (503, b'{"error": {"code": "no_blocks", "message": "' + b"m" * 5000 + b'"}}'),
    }

    async def answer(request: web.Request) -> web.Response:
        status, body = bodies[request.path]
        return web.Response(body=body, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_post("/{name}", answer)
    async with serving(app) as url:
        yield url


async def test_a_peers_answer_is_read_within_limits(answering_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 30
        big = await post_json(session, f"{answering_url}/big", {}, deadline)
        deep = await post_json(session, f"{answering_url}/deep", {}, deadline)
        fine = await post_json(session, f"{answering_url}/fine", {}, deadline)
    assert big.ok and big.body is None
    assert deep.ok and deep.body is None
    error = fine.error()
    assert error.code == "no_blocks"
    assert len(str(error)) < peer_http.MAX_MESSAGE_CHARS + 100
