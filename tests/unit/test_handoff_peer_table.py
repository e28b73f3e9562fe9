"""The decode worker's table of prefill workers: bounded, least recently used first,
and a failed meeting remembered for a while (not tried again by every request)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import aiohttp
import pytest
import torch

from pdserve.workers.handoff.blocking import BlockingCalls
from pdserve.workers.handoff.errors import HandoffError
from pdserve.workers.handoff.peers import PrefillPeers
from pdserve.workers.kv_transfer.layout import KVLayout
from support.fake_peer import scripted_peer
from support.network import refusing_url

if TYPE_CHECKING:  # imported for real below, where NIXL is installed
    from pdserve.workers.kv_transfer.nixl import NixlAgent

nixl = pytest.importorskip("pdserve.workers.kv_transfer.nixl")


@pytest.fixture
def agent() -> Iterator[NixlAgent]:
    cache = torch.zeros((2, 8, 2, 4, 1, 2))
    agent = nixl.NixlAgent("decode-table", cache, KVLayout.of(cache, model="m", weights="w"))
    yield agent
    agent.close()


async def test_the_least_recently_used_idle_peer_makes_room(agent: NixlAgent) -> None:
    calls = BlockingCalls()
    peers = PrefillPeers(agent, calls, max_peers=2)
    with ExitStack() as stack:
        urls = [
            stack.enter_context(scripted_peer(lambda body, layout: (500, "not asked here")))
            for _ in range(3)
        ]
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            pairs = []
            for url in urls[:2]:
                pairs.append(await peers.hold(session, url, deadline))
                peers.let_go(url)
            assert len(peers) == 2
            # The first is in use while the third comes: the second one goes.
            assert await peers.hold(session, urls[0], deadline) == pairs[0]
            await peers.hold(session, urls[2], deadline)
            peers.let_go(urls[2])
            assert len(peers) == 2
            assert await peers.hold(session, urls[1], deadline) != pairs[1]  # met again
            peers.let_go(urls[1])
            peers.let_go(urls[0])
    await peers.close()
    calls.close()


async def test_a_failed_meeting_is_remembered_for_a_while(agent: NixlAgent) -> None:
    calls = BlockingCalls()
    peers = PrefillPeers(agent, calls, failure_memory_s=60)
    with refusing_url() as url:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(HandoffError) as first:
                await peers.hold(session, url, time.monotonic() + 30)
            with pytest.raises(HandoffError) as again:
                await peers.hold(session, url, time.monotonic() + 30)
    assert first.value.code == again.value.code == "connect_failed"
    assert "not tried again yet" in str(again.value)
    await peers.close()
    calls.close()
