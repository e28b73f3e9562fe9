"""KV transfer over torch.distributed point-to-point: gloo on CPU, NCCL on CUDA.

Each prefill/decode pair gets its own 2-rank process group (see torch_pair.py). The
decode agent hosts a TCPStore (its address is in its metadata); `accept(peer)` joins
the pair's group as rank 0 and blocks until the prefill side's `connect(peer)` joins
as rank 1. Both sides must name the pair with the same `peer` string (the hand-off's
pair id): it keys the group in the store, so a reconnection under a new id meets in
a fresh group.

A transfer is one message per run of consecutive destination blocks (per layer
where the cache is layer-major: a block-major one holds a run's layers together). The
decode side posts its receives straight into those runs of its cache (`expect`), the
prefill side posts the matching sends (`write`), both in the same order (layers
outer, runs inner) and under a tag derived from the transfer id, so transfers running
at once on a pair do not mix. The sender does not know where the receiver's runs
break until it is asked, so where its own blocks are not consecutive inside one
destination run it gathers them into one buffer first (the receiver never copies).

A posted receive takes whatever the sender sends for it, so the receive, not the
clock, says when the decode worker may free its blocks: once the receive completed,
or the pair was dropped. A transfer that will carry no data is completed with filler
by the sender (`decline`), so that one transfer that fails or is given up leaves the
pair, and the transfers running on it, alone. A wait that runs out of time is another
matter: gloo closes the pair's connection then, so a receive or a send that does not
complete in time drops the pair on its side (every transfer pending on it fails, and
the next hand-off meets again); with every transfer completed one way or the other,
that happens only when a peer is gone or stuck.

Peers: beyond `max_peers` pairs, the least recently used idle pair is dropped (a
decode worker that drops a pair says so when it meets again, see handoff/peers.py).
A store client goes with the last pair that met through it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, Store

from pdserve.workers import faults
from pdserve.workers.kv_transfer.base import (
    MAX_PEERS,
    KVTransferAgent,
    NotConnectedError,
    PendingReceive,
    TransferError,
    TransferStats,
    check_backend,
    seconds_left,
)
from pdserve.workers.kv_transfer.blocks import check_blocks, runs
from pdserve.workers.kv_transfer.layout import BLOCK_MAJOR, KVLayout, LayoutMismatchError
from pdserve.workers.kv_transfer.torch_pair import (
    DECODE_RANK,
    PREFILL_RANK,
    Pair,
    StoreServer,
    open_group,
    store_client,
)

_Address = tuple[str, int]  # host, port


@dataclass(frozen=True)
class TorchPeer:
    """What a torch.distributed peer published: its store and its cache's kind."""

    name: str
    host: str
    port: int
    device: str  # "cpu" (gloo) or "cuda" (NCCL)
    layout: KVLayout

    @classmethod
    def from_metadata(cls, raw: dict[str, Any]) -> TorchPeer:
        """Parse `TorchDistAgent.metadata()` of a peer (ValueError when malformed)."""
        check_backend(raw, "torch")
        try:
            return cls(
                name=str(raw["name"]),
                host=str(raw["store_host"]),
                port=int(raw["store_port"]),
                device=str(raw["device"]),
                layout=KVLayout.from_json(raw["layout"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed torch.distributed metadata: {error}") from error


class _Receive(PendingReceive):
    """Receives posted into the destination blocks."""

    def __init__(self, agent: TorchDistAgent, peer: str, pair: Pair, transfer_id: str) -> None:
        self._agent = agent
        self._peer = peer
        self._pair = pair
        self._transfer_id = transfer_id
        self._lock = threading.Lock()  # one wait at a time
        self._received = False
        self._failed: TransferError | None = None  # then the pair was dropped

    def wait(self, timeout_s: float) -> None:
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._received:
                return
            what = f"receiving transfer {self._transfer_id} from {self._peer}"
            try:
                self._pair.wait(self._transfer_id, time.monotonic() + timeout_s, what)
            except TransferError as error:
                # A receive that times out closes gloo's connection: the pair is
                # broken whatever the cause, and dropping it withdraws the receive.
                self._failed = error
                self._agent.drop(self._peer, self._pair)
                raise
            self._received = True

    def withdraw(self, timeout_s: float) -> bool:
        # A posted receive cannot be withdrawn alone: it gets until the timeout to
        # complete (a sender that will not write declines), then dropping the pair
        # makes sure nothing lands in blocks about to be freed.
        with contextlib.suppress(TransferError):
            self.wait(timeout_s)
        return True


class TorchDistAgent(KVTransferAgent):
    """A worker's torch.distributed end of KV transfers (gloo or NCCL by device)."""

    backend = "torch"

    def __init__(
        self,
        name: str,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        host: str = "127.0.0.1",
        max_peers: int = MAX_PEERS,
    ) -> None:
        super().__init__(name, kv_cache, layout)
        self.host = host
        self.max_peers = max_peers
        self.kind = "nccl" if kv_cache.device.type == "cuda" else "gloo"
        self._server: StoreServer | None = None
        self._clients: dict[tuple[str, int], Store] = {}
        self._pairs: OrderedDict[str, Pair] = OrderedDict()  # by pair id, LRU first
        # Prefill side: the decode agent's store each pair met through.
        self._met_through: dict[str, _Address] = {}
        self._lock = threading.Lock()

    def metadata(self) -> dict[str, Any]:
        """Where this agent's store listens, its device kind and its layout."""
        server = self._serve()
        return {
            "backend": self.backend,
            "name": self.name,
            "store_host": server.host,
            "store_port": server.port,
            "device": self.kv_cache.device.type,
            "layout": self.layout.to_json(),
        }

    def accept(self, peer: str, timeout_s: float) -> None:
        """Join `peer`'s group as rank 0; blocks until the prefill side has joined."""
        store = PrefixStore(_prefix(peer), self._serve().store)
        self._join(peer, store, DECODE_RANK, timeout_s, client=None)

    def connect(self, peer: str, metadata: dict[str, Any], timeout_s: float) -> None:
        """Check layouts, then join `peer`'s group as rank 1 (at once if joined)."""
        remote = TorchPeer.from_metadata(metadata)
        self.layout.check_compatible(
            remote.layout, local=f"this worker ({self.name})", remote=f"peer {remote.name}"
        )
        if remote.device != self.kv_cache.device.type:
            raise LayoutMismatchError(
                f"KV cache devices differ: this worker ({self.name}) has "
                f"{self.kv_cache.device.type}, peer {remote.name} has {remote.device} "
                "(gloo and NCCL cannot meet)"
            )
        if peer in self._pairs:
            return
        store = PrefixStore(_prefix(peer), self._client(remote, timeout_s))
        self._join(peer, store, PREFILL_RANK, timeout_s, client=(remote.host, remote.port))

    def expect(self, peer: str, blocks: list[int], transfer_id: str) -> PendingReceive:
        """Post receives straight into the runs of `blocks` (layer by layer where the
        cache is layer-major)."""
        pair = self._pair(peer)
        check_blocks(blocks, self.layout.num_blocks, "destination")
        views = [
            cache[run.start : run.start + run.count]
            for cache in self._by_block()
            for run in runs(blocks)
        ]
        try:
            pair.post_recvs(transfer_id, views, _tag(transfer_id))
        except (TransferError, RuntimeError) as error:
            self.drop(peer, pair)
            raise TransferError(f"transfer {transfer_id} from {peer}: {error}") from error
        return _Receive(self, peer, pair, transfer_id)

    def write(
        self,
        peer: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        transfer_id: str,
        timeout_s: float,
        cancelled: threading.Event | None = None,
    ) -> TransferStats:
        """Send local blocks into the peer's, one message per destination run per
        layer; returns once every send has completed. The receiver waits for these
        sends, so a cancel does not stop them (they are as cheap as a decline)."""
        started = time.monotonic()
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(
                f"block counts differ: {len(local_blocks)} to send, {len(remote_blocks)} to receive"
            )
        check_blocks(local_blocks, self.layout.num_blocks, "source")
        messages = self._outgoing(local_blocks, remote_blocks)
        self._send(peer, messages, transfer_id, started + timeout_s)
        return TransferStats(
            bytes=sum(m.numel() * m.element_size() for m in messages),
            seconds=time.monotonic() - started,
            descriptors=len(messages),
        )

    def decline(
        self, peer: str, remote_blocks: list[int], transfer_id: str, timeout_s: float
    ) -> None:
        """Fill the receives posted for `transfer_id` with zeros, so they complete."""
        pieces = runs(remote_blocks)
        if not pieces:
            return
        caches = self._by_block()
        filler = torch.zeros_like(caches[0][: max(run.count for run in pieces)])
        messages = [filler[: run.count] for _ in caches for run in pieces]
        self._send(peer, messages, transfer_id, time.monotonic() + timeout_s)

    def disconnect(self, peer: str) -> None:
        """Drop `peer`'s pair, if any."""
        with self._lock:
            pair = self._pairs.get(peer)
        if pair is not None:
            self.drop(peer, pair)

    def is_connected(self, peer: str) -> bool:
        """Whether `peer`'s pair is held and open."""
        with self._lock:
            pair = self._pairs.get(peer)
        return pair is not None and not pair.closed

    def num_peers(self) -> int:
        """Pairs held."""
        with self._lock:
            return len(self._pairs)

    def drop(self, peer: str, pair: Pair) -> None:
        """Close `pair` and forget it (if it is still `peer`'s); never raises."""
        with self._lock:
            if self._pairs.get(peer) is pair:
                del self._pairs[peer]
                self._met_through.pop(peer, None)
                self._forget_unused_clients()
        pair.close()

    def close(self) -> None:
        """Close every pair and stop the store."""
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), OrderedDict()
            self._met_through.clear()
            self._clients.clear()
        for pair in pairs:
            pair.close()
        if self._server is not None:
            self._server.close()

    def _send(
        self, peer: str, messages: list[torch.Tensor], transfer_id: str, deadline: float
    ) -> None:
        """Post a transfer's sends and wait for them; a failure drops the pair."""
        pair = self._pair(peer)
        what = f"sending transfer {transfer_id} to {peer}"
        seconds_left(deadline, what)  # out of time before anything was posted: no harm done
        try:
            faults.blocking_point("kv_transfer.before_post")
            pair.post_sends(transfer_id, messages, _tag(transfer_id), deadline)
            pair.wait(transfer_id, deadline, what)
        except (TransferError, RuntimeError) as error:
            self.drop(peer, pair)
            raise TransferError(f"{what} failed: {error}") from error

    def _outgoing(self, local: list[int], remote: list[int]) -> list[torch.Tensor]:
        """The tensor of each message, in the receiver's order: a view where the
        local blocks of a destination run are consecutive too, else a gathered copy."""
        messages: list[torch.Tensor] = []
        pieces = [(run, local[run.position : run.position + run.count]) for run in runs(remote)]
        for cache in self._by_block():
            for run, sources in pieces:
                first = sources[0]
                if sources == list(range(first, first + run.count)):
                    messages.append(cache[first : first + run.count])
                else:
                    index = torch.tensor(sources, device=cache.device)
                    messages.append(cache.index_select(0, index))
        return messages

    def _by_block(self) -> list[torch.Tensor]:
        """The cache as dense tensors indexed by block first, one message per run of
        blocks in each: all layers at once in a block-major cache, else each layer."""
        if self.layout.order == BLOCK_MAJOR:
            return [self.kv_cache.transpose(0, 1)]
        return [self.kv_cache[layer] for layer in range(self.layout.num_layers)]

    def _join(
        self, peer: str, store: Store, rank: int, timeout_s: float, client: _Address | None
    ) -> None:
        device = self.kv_cache.device
        group = open_group(self.kind, store, rank, timeout_s, self.host, device)
        pair = Pair(group, self.kind, rank, store)
        with self._lock:
            stale = [self._pairs.pop(peer)] if peer in self._pairs else []
            self._pairs[peer] = pair
            if client is not None:
                self._met_through[peer] = client
            idle = [p for p, held in self._pairs.items() if p != peer and not held.busy]
            for evicted in idle[: max(0, len(self._pairs) - self.max_peers)]:
                stale.append(self._pairs.pop(evicted))
                self._met_through.pop(evicted, None)
            self._forget_unused_clients()
        for old in stale:
            old.close()

    def _pair(self, peer: str) -> Pair:
        with self._lock:
            pair = self._pairs.get(peer)
            if pair is not None:
                self._pairs.move_to_end(peer)
        if pair is None or pair.closed:
            raise NotConnectedError(f"not connected to {peer} (or the connection was dropped)")
        return pair

    def _forget_unused_clients(self) -> None:
        """Drop store clients no held pair met through (lock held)."""
        used = set(self._met_through.values())
        for key in [key for key in self._clients if key not in used]:
            del self._clients[key]

    def _serve(self) -> StoreServer:
        with self._lock:
            if self._server is None:
                self._server = StoreServer(self.host)
            return self._server

    def _client(self, remote: TorchPeer, timeout_s: float) -> Store:
        key = (remote.host, remote.port)
        with self._lock:
            client = self._clients.get(key)
        if client is None:
            client = store_client(remote.host, remote.port, timeout_s)
            with self._lock:
                self._clients[key] = client
        return client


def _prefix(peer: str) -> str:
    return f"pdserve/kv/{peer}/"


def _tag(transfer_id: str) -> int:
    """The transfer's message tag: both ends derive it from the id alone."""
    return zlib.crc32(transfer_id.encode()) & 0x7FFFFFFF
