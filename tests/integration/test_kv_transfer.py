"""KV transfer between two processes, for each backend: the bytes land exactly where
the decode side asked, nothing else moves, mismatched caches are refused, and a dead
or silent peer costs a deadline, never a hang."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pdserve.workers.kv_transfer.blocks import runs
from pdserve.workers.kv_transfer.layout import segments
from support.kv_agents import AgentCallError, AgentProcess, CacheSpec, agent_process

pytestmark = pytest.mark.starts_first  # among the longest files of the run

BACKENDS = ["nixl", "torch"]
DECODE_SPEC = CacheSpec(num_blocks=24)
PREFILL_SPEC = CacheSpec(num_blocks=20)  # each side sizes its own cache
BLOCK_BYTES = 2 * 4 * 2 * 8 * 4  # K and V, 4 tokens, 2 heads, head_dim 8, float32
DEADLINE_S = 2.0
# A deadline far beyond any test's patience: a failure before it was not the clock's.
DEAD_PEER_DEADLINE_S = 600.0
# What a call given no time says: it was refused on its budget, not tried.
SPENT_BUDGET = "deadline has passed|no time left"
# Pipe round trips on a loaded machine; far below the 30 s of a default timeout, and
# a wait without end never ends at all.
SLACK_S = 8.0
# A pair's meeting where a test does not judge its deadline: two new processes' first
# gloo handshake, which on a machine loaded many times over takes far longer than the
# product's default (a hand-off that cannot meet in that time fails, by design).
JOIN_S = 120.0


@dataclass
class Pair:
    backend: str
    decode: AgentProcess
    prefill: AgentProcess
    peer: str


def start_pair(stack: ExitStack, backend: str) -> tuple[AgentProcess, AgentProcess]:
    """A decode and a prefill agent process, started side by side."""
    decode = stack.enter_context(agent_process(backend, "decode-0", DECODE_SPEC, seed=1))
    prefill = stack.enter_context(agent_process(backend, "prefill-0", PREFILL_SPEC, seed=2))
    return decode, prefill


def connect(
    decode: AgentProcess, prefill: AgentProcess, peer: str, timeout_s: float = JOIN_S
) -> None:
    """The decode worker's meeting: accept beside the prefill side's connect. Both
    agents are built first (a new process imports torch, which can take minutes on a
    loaded machine), so the accept's deadline covers the meeting alone."""
    metadata = decode.call("metadata")
    prefill.call("peers")
    decode.send("accept", peer, timeout_s)
    prefill.call("connect", peer, metadata, timeout_s, timeout_s=timeout_s + SLACK_S)
    decode.receive(timeout_s + SLACK_S)


def transfer(pair: Pair, src: list[int], dst: list[int], transfer_id: str) -> dict[str, Any]:
    """One hand-off's transfer, in the order the workers make the calls."""
    pair.decode.call("expect", pair.peer, dst, transfer_id)
    pair.prefill.send("write", pair.peer, src, dst, transfer_id, DEADLINE_S)
    pair.decode.send("wait", transfer_id, DEADLINE_S)
    stats: dict[str, Any] = pair.prefill.receive()
    pair.decode.receive()
    return stats


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    with ExitStack() as stack:
        decode, prefill = start_pair(stack, request.param)
        connect(decode, prefill, "pair-0")
        yield Pair(request.param, decode, prefill, "pair-0")


def expected_descriptors(backend: str, src: list[int], dst: list[int]) -> int:
    """NIXL copies one segment per layer; torch sends one message per destination run
    per layer (the receiver cannot know where the sender's blocks break)."""
    pieces = segments(src, dst) if backend == "nixl" else runs(dst)
    return int(len(pieces) * DECODE_SPEC.num_layers)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([3, 4, 5, 9], [10, 11, 12, 13]),
        ([0, 1, 2, 3, 4, 5, 6, 7], [16, 17, 18, 19, 20, 21, 22, 23]),
        ([19, 3, 4, 11, 12, 13], [0, 5, 6, 7, 8, 2]),
    ],
)
def test_blocks_land_exactly_where_asked_and_nothing_else_moves(
    pair: Pair, src: list[int], dst: list[int]
) -> None:
    before = pair.decode.call("cache")
    source = pair.prefill.call("cache")

    stats = transfer(pair, src, dst, f"t-{src[0]}-{dst[0]}")

    after = pair.decode.call("cache")
    assert torch.equal(after[:, dst], source[:, src])
    untouched = [b for b in range(DECODE_SPEC.num_blocks) if b not in dst]
    assert torch.equal(after[:, untouched], before[:, untouched])
    assert stats["bytes"] == len(src) * DECODE_SPEC.num_layers * BLOCK_BYTES
    assert stats["descriptors"] == expected_descriptors(pair.backend, src, dst)


def test_descriptors_of_the_example_hand_off(pair: Pair) -> None:
    stats = transfer(pair, [3, 4, 5, 9], [10, 11, 12, 13], "t-example")
    layers = DECODE_SPEC.num_layers
    assert stats["descriptors"] == (2 * layers if pair.backend == "nixl" else 1 * layers)


def test_transfers_outstanding_together_do_not_mix(pair: Pair) -> None:
    source = pair.prefill.call("cache")
    first, second = ([1, 2, 3], [4, 5, 6]), ([7, 8], [14, 15])
    pair.decode.call("expect", pair.peer, first[1], "t-first")
    pair.decode.call("expect", pair.peer, second[1], "t-second")
    # The prefill side finishes the later request first.
    pair.prefill.call("write", pair.peer, *second, "t-second", DEADLINE_S)
    pair.prefill.call("write", pair.peer, *first, "t-first", DEADLINE_S)
    pair.decode.call("wait", "t-first", DEADLINE_S)
    pair.decode.call("wait", "t-second", DEADLINE_S)

    after = pair.decode.call("cache")
    for src, dst in (first, second):
        assert torch.equal(after[:, dst], source[:, src])


@pytest.mark.parametrize(
    ("field", "theirs"), [("block_size", 8), ("dtype", "bfloat16"), ("num_layers", 4)]
)
def test_a_layout_mismatch_is_refused_at_connect(pair: Pair, field: str, theirs: Any) -> None:
    # What a decode worker configured differently publishes.
    metadata = pair.decode.call("metadata")
    ours = metadata["layout"][field]
    metadata["layout"][field] = theirs

    with pytest.raises(AgentCallError) as refused:
        pair.prefill.call("connect", f"mismatch-{field}", metadata, 5.0)

    assert refused.value.kind == "LayoutMismatchError"
    first_line = refused.value.message.splitlines()[0]
    assert field in first_line and str(ours) in first_line and str(theirs) in first_line


def assert_fails_in_time(
    call: AgentProcess, kind: str = "TransferError", deadline_s: float = DEADLINE_S
) -> tuple[float, str]:
    """The pending call's answer is `kind`, within its deadline (`deadline_s`): the
    time it took and the error's message."""
    started = time.monotonic()
    with pytest.raises(AgentCallError) as failed:
        call.receive(timeout_s=deadline_s + SLACK_S)
    elapsed = time.monotonic() - started
    assert failed.value.kind == kind, failed.value.message
    assert elapsed < deadline_s + SLACK_S
    return elapsed, failed.value.message


def test_a_killed_decode_worker_fails_the_write_and_the_next_connect_in_time(pair: Pair) -> None:
    with agent_process(pair.backend, "decode-doomed", DECODE_SPEC, seed=3) as doomed:
        metadata = doomed.call("metadata")
        connect(doomed, pair.prefill, "pair-doomed")
        doomed.call("expect", "pair-doomed", [1, 2, 3], "t-doomed")
        doomed.kill()

        pair.prefill.send("write", "pair-doomed", [1, 2, 3], [1, 2, 3], "t-doomed", DEADLINE_S)
        assert_fails_in_time(pair.prefill)

        started = time.monotonic()
        try:
            pair.prefill.call("connect", "pair-late", metadata, DEADLINE_S)
        except AgentCallError as error:  # torch: the store is gone
            assert error.kind == "TransferError", error.message
        else:  # NIXL knows the agent already; the next write is what fails
            pair.prefill.send("write", "pair-late", [1], [1], "t-late", DEADLINE_S)
            assert_fails_in_time(pair.prefill)
        assert time.monotonic() - started < DEADLINE_S + SLACK_S

    # The prefill worker still serves its other decode workers.
    transfer(pair, [1], [1], "t-survivor")


def test_connect_without_accept(pair: Pair) -> None:
    metadata = pair.decode.call("metadata")
    pair.prefill.send("connect", "pair-unaccepted", metadata, DEADLINE_S)
    if pair.backend == "nixl":  # one-sided: the decode side takes no part
        pair.prefill.receive()
        return
    elapsed, _ = assert_fails_in_time(pair.prefill)
    assert elapsed >= DEADLINE_S * 0.9  # it waited for the peer, then gave up


@pytest.mark.parametrize("pair", ["torch"], indirect=True)
def test_torch_receive_failures_surface_in_time_and_the_pair_reconnects(pair: Pair) -> None:
    decode = pair.decode
    with agent_process("torch", "prefill-doomed", PREFILL_SPEC, seed=4) as prefill:
        connect(decode, prefill, "pair-r1")
        source = prefill.call("cache")

        # A prefill worker that never writes: the receive times out...
        decode.call("expect", "pair-r1", [1, 2], "t-silent")
        decode.send("wait", "t-silent", DEADLINE_S)
        assert_fails_in_time(decode)
        # ...and the pair is dropped on the decode side: it must meet again.
        with pytest.raises(AgentCallError, match="not connected"):
            decode.call("expect", "pair-r1", [3], "t-after")
        connect(decode, prefill, "pair-r2")
        transfer(Pair("torch", decode, prefill, "pair-r2"), [5, 6], [7, 8], "t-again")
        assert torch.equal(decode.call("cache")[:, [7, 8]], source[:, [5, 6]])

        # A prefill worker that dies: the receive fails because the peer is gone, not
        # because its deadline passed (one no test waits for).
        decode.call("expect", "pair-r2", [9, 10], "t-dead")
        prefill.kill()
        decode.send("wait", "t-dead", DEAD_PEER_DEADLINE_S)
        _, message = assert_fails_in_time(decode, deadline_s=DEAD_PEER_DEADLINE_S)
        assert "before its deadline" not in message, message


def test_a_declined_transfer_leaves_the_pair_and_its_other_transfers_alone(pair: Pair) -> None:
    before = pair.decode.call("cache")
    source = pair.prefill.call("cache")
    declined, written = ([1, 2], [3]), ([4, 5], [6, 7])
    pair.decode.call("expect", pair.peer, declined[1], "t-declined")
    pair.decode.call("expect", pair.peer, written[1], "t-written")

    # The prefill worker gives up on one hand-off (say its client left) and serves
    # the other.
    pair.prefill.call("decline", pair.peer, declined[1], "t-declined", DEADLINE_S)
    pair.prefill.call("write", pair.peer, *written, "t-written", DEADLINE_S)
    pair.decode.call("wait", "t-written", DEADLINE_S)
    certain = pair.decode.call("withdraw", "t-declined", DEADLINE_S)

    after = pair.decode.call("cache")
    assert torch.equal(after[:, written[1]], source[:, written[0]])
    # torch filled the declined receive (it is over); NIXL never had one.
    assert certain is (pair.backend == "torch")
    untouched = [b for b in range(DECODE_SPEC.num_blocks) if b not in declined[1] + written[1]]
    assert torch.equal(after[:, untouched], before[:, untouched])
    # The pair is still the same connection.
    transfer(pair, [8], [9], "t-after-decline")
    assert torch.equal(pair.decode.call("cache")[:, [9]], source[:, [8]])


def test_a_spent_budget_fails_at_once_and_harms_nothing(pair: Pair) -> None:
    source = pair.prefill.call("cache")
    # Refused on its budget before anything is tried (a spent budget never reaches an
    # API where 0 means "wait forever").
    pair.prefill.send("write", pair.peer, [1], [1], "t-no-time", 0.0)
    _, message = assert_fails_in_time(pair.prefill)
    assert re.search(SPENT_BUDGET, message), message
    if pair.backend == "torch":  # meeting takes a rendezvous (NIXL's never waits)
        # A meeting with no time left fails too, instead of waiting without end.
        metadata = pair.decode.call("metadata")
        pair.prefill.send("connect", "pair-no-time", metadata, 0.0)
        _, message = assert_fails_in_time(pair.prefill)
        assert re.search(SPENT_BUDGET, message), message
    transfer(pair, [2], [3], "t-after-no-time")
    assert torch.equal(pair.decode.call("cache")[:, [3]], source[:, [2]])


def test_peers_beyond_the_bound_go_least_recently_used_first(pair: Pair) -> None:
    small = CacheSpec(num_blocks=20, max_peers=2)
    with agent_process(pair.backend, "prefill-bounded", small, seed=6) as prefill:
        for name in ("pair-b0", "pair-b1"):
            connect(pair.decode, prefill, name)
        transfer(Pair(pair.backend, pair.decode, prefill, "pair-b0"), [1], [2], "t-b0")
        connect(pair.decode, prefill, "pair-b2")  # pair-b1 was used least recently
        with pytest.raises(AgentCallError) as dropped:
            prefill.call("write", "pair-b1", [1], [2], "t-b1", DEADLINE_S)
        assert dropped.value.kind == "NotConnectedError"
        for name in ("pair-b0", "pair-b2"):
            transfer(Pair(pair.backend, pair.decode, prefill, name), [3], [4], f"t-{name}")
        # A pair the decode worker dropped is dropped here when it says so.
        prefill.call("disconnect", "pair-b0")
        with pytest.raises(AgentCallError, match="NotConnectedError"):
            prefill.call("write", "pair-b0", [1], [2], "t-b0-gone", DEADLINE_S)
        # torch: pair-b2's group; NIXL: the one decode agent all the ids name.
        assert prefill.call("peers") == 1
    for name in ("pair-b0", "pair-b1", "pair-b2"):
        pair.decode.call("disconnect", name)
