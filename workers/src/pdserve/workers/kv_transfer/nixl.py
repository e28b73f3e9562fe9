"""KV transfer over NIXL with its UCX backend: the prefill worker WRITEs one-sidedly
into the decode worker's cache, which was registered with UCX once, at start.

A transfer is one NIXL request holding one descriptor per segment (block-major
caches, the engine's) or per segment per layer (see layout.py): each a contiguous
range on both sides, so a sequence whose blocks mostly run consecutively moves as a
few large copies. Descriptors are prepared once, not per transfer: one list of every
block (or every block of every layer) of the local cache, and one of each decode
agent's, prepared when the agent is loaded; a transfer names blocks by index into
both, and NIXL merges the indices that run consecutively on both sides into one
copy. What a transfer costs beyond the copy is then a few microseconds of index
arrays and one request made, posted and released. The decode side takes no part in
the copy: its `PendingReceive.wait` returns at once, and the prefill worker's answer to
the hand-off request (sent after `write` returned) says the bytes have landed.

Transports (UCX chooses; `UCX_TLS` narrows the choice): between processes of one host
the writes go by cma (one kernel copy, process_vm_writev), across hosts by RDMA or
TCP. Connection set-up and NIXL's own messages need an active-message transport
that can report a failed peer, which UCX's shared-memory ones cannot: on one host
that is TCP over loopback, so `UCX_TLS` must keep `tcp` (plain `sm` fails to start).

On failure or cancel (`TransferError`) the request is released, which asks UCX to
cancel what it has not copied yet; the destination blocks then hold an unknown mix of
old and new bytes, and the decode worker must not adopt them. The decode side cannot
withdraw a one-sided write (`withdraw` says so): it keeps the blocks until the prefill
worker says its write has stopped, or until the lease and a margin have passed, which
outlast the write's deadline.

Peers: a decode agent loaded once is addressed by every pair id it met under; pair
ids beyond `max_peers` go least recently used first, and remote agents no pair id
refers to are unloaded once no write to them runs.
"""

from __future__ import annotations

import base64
import logging
import operator
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from nixl._api import (
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

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
from pdserve.workers.kv_transfer.blocks import check_blocks
from pdserve.workers.kv_transfer.layout import (
    BLOCK_MAJOR,
    KVLayout,
    Segment,
    memory_order,
)

log = logging.getLogger(__name__)

UCX = "UCX"
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"  # names the local side of a prepared list
# Polling a running request: spin briefly (small writes finish within microseconds),
# then back off so a long write does not take a core from the engine.
_SPIN_POLLS = 200
_MAX_SLEEP_S = 0.001
# Rows of a prepared list, as NIXL takes them.
Indices = list[int] | npt.NDArray[np.int32]
# Measured idle cost of the pump: ~3% of one core at 2 ms.
_PUMP_PERIOD_S = 0.002


@dataclass(frozen=True)
class NixlPeer:
    """What a NIXL peer published: enough to address its registered cache."""

    agent_name: str
    agent_metadata: bytes
    base_address: int
    memory: str  # NIXL memory kind: "DRAM" or "VRAM"
    device_id: int
    layout: KVLayout

    @classmethod
    def from_metadata(cls, raw: dict[str, Any]) -> NixlPeer:
        """Parse `NixlAgent.metadata()` of a peer (ValueError when malformed)."""
        check_backend(raw, "nixl")
        try:
            return cls(
                agent_name=str(raw["agent_name"]),
                agent_metadata=base64.b64decode(raw["agent_metadata"], validate=True),
                base_address=int(raw["base_address"]),
                memory=str(raw["memory"]),
                device_id=int(raw["device_id"]),
                layout=KVLayout.from_json(raw["layout"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed NIXL metadata: {error}") from error


class _Landed(PendingReceive):
    """A one-sided write needs nothing from the receiver, and cannot be stopped by it."""

    def wait(self, timeout_s: float) -> None:
        return None

    def withdraw(self, timeout_s: float) -> bool:
        return False


class NixlAgent(KVTransferAgent):
    """A worker's NIXL agent over its KV cache (DRAM on CPU, VRAM on CUDA)."""

    backend = "nixl"

    def __init__(
        self, name: str, kv_cache: torch.Tensor, layout: KVLayout, max_peers: int = MAX_PEERS
    ) -> None:
        super().__init__(name, kv_cache, layout)
        self.max_peers = max_peers
        memory_order(kv_cache)  # ValueError unless the cache is one dense region
        self.memory, self.device_id = memory_kind(kv_cache)
        self.base_address = kv_cache.data_ptr()
        # NIXL's own progress thread polls without pause (its Python API fixes the
        # delay at 0): a core per worker, idle or not. A write progresses while its
        # writer polls it; a pump answers what peers ask of a decode agent
        # (connection set-up) at a small cost. Reader-writer sync: hand-offs write
        # from several threads at once, while adding a peer takes the agent alone.
        config = nixl_agent_config(
            enable_prog_thread=False,
            backends=[UCX],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        self._agent = nixl_agent(name, config)
        if UCX not in self._agent.backends:
            raise RuntimeError("NIXL was built without its UCX backend")
        region = (self.base_address, kv_cache.numel() * kv_cache.element_size(), self.device_id, "")
        self._registered = self._agent.register_memory([region], self.memory, backends=[UCX])
        self._metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        self._peers: OrderedDict[str, NixlPeer] = OrderedDict()  # by pair id, LRU first
        self._loaded: dict[str, bytes] = {}  # remote agents loaded: name -> metadata
        self._writing: Counter[str] = Counter()  # writes running, by remote agent
        # Prepared descriptor lists: this cache's (made by the first connect: only a
        # writer needs it) and each loaded remote agent's, by name.
        self._local_list: nixl_prepped_dlist_handle | None = None
        self._remote_lists: dict[str, nixl_prepped_dlist_handle] = {}
        self._lock = threading.Lock()  # the maps above; held briefly
        # Loading and unloading remote agents, one at a time; a slow peer holds up
        # other meetings, never writes.
        self._meeting = threading.Lock()
        self._pump: _Pump | None = None  # started by the first accept

    def metadata(self) -> dict[str, Any]:
        """The agent's NIXL metadata, where its cache lives, and its layout."""
        return {
            "backend": self.backend,
            "agent_name": self.name,
            "agent_metadata": self._metadata,
            "base_address": self.base_address,
            "memory": self.memory,
            "device_id": self.device_id,
            "layout": self.layout.to_json(),
        }

    def accept(self, peer: str, timeout_s: float) -> None:
        """Get ready to be written to: the prefill side loads this agent's metadata
        and writes; this side only has to answer its connection requests, which the
        pump does from the first accept on (prefill agents, never written to, spare
        themselves the pump)."""
        with self._lock:
            if self._pump is None:
                self._pump = _Pump(self._agent)

    def connect(self, peer: str, metadata: dict[str, Any], timeout_s: float) -> None:
        """Check layouts, then load the decode agent's metadata (once per agent; a
        peer that restarted under the same name is loaded afresh)."""
        remote = NixlPeer.from_metadata(metadata)
        self.layout.check_compatible(
            remote.layout, local=f"this worker ({self.name})", remote=f"peer {remote.agent_name}"
        )
        name = remote.agent_name
        with self._meeting:
            with self._lock:
                known = self._loaded.get(name)
            try:
                if known is not None and known != remote.agent_metadata:
                    self._unload([name])
                    known = None
                if self._local_list is None:
                    mine = (self.layout, self.base_address, self.memory, self.device_id)
                    self._local_list = self._prepare(NIXL_INIT_AGENT, *mine)
                if known is None:
                    self._agent.add_remote_agent(remote.agent_metadata)
                    with self._lock:
                        self._loaded[name] = remote.agent_metadata
                    # Sets up the UCX endpoint now rather than in the first write.
                    self._agent.make_connection(name, [UCX])
                    theirs = (remote.layout, remote.base_address, remote.memory, remote.device_id)
                    far = self._prepare(name, *theirs)
                    with self._lock:
                        self._remote_lists[name] = far
            except Exception as error:  # NIXL raises its own classes, all Exceptions
                message = f"could not reach NIXL agent {name}: {error}"
                raise TransferError(message) from error
            with self._lock:
                self._peers[peer] = remote
                while len(self._peers) > self.max_peers:
                    self._peers.popitem(last=False)
            self._unload(self._unused())

    def disconnect(self, peer: str) -> None:
        """Forget a pair id; its agent is unloaded once no pair id and no write uses it."""
        with self._meeting:
            with self._lock:
                self._peers.pop(peer, None)
            self._unload(self._unused())

    def is_connected(self, peer: str) -> bool:
        """Whether `peer` is a pair id this agent holds."""
        with self._lock:
            return peer in self._peers

    def num_peers(self) -> int:
        """Remote agents loaded."""
        with self._lock:
            return len(self._loaded)

    def expect(self, peer: str, blocks: list[int], transfer_id: str) -> PendingReceive:
        """The write is one-sided: nothing to wait for here."""
        check_blocks(blocks, self.layout.num_blocks, "destination")
        return _Landed()

    def write(
        self,
        peer: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        transfer_id: str,
        timeout_s: float,
        cancelled: threading.Event | None = None,
    ) -> TransferStats:
        """One NIXL WRITE of the blocks, by index into the prepared lists of both
        caches; returns once UCX reports it complete (the bytes are in the peer's
        memory)."""
        started = time.monotonic()
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(
                f"block counts differ: {len(local_blocks)} to send, {len(remote_blocks)} to receive"
            )
        with self._lock:
            remote = self._peers.get(peer)
            far_list = self._remote_lists.get(remote.agent_name) if remote else None
            if remote is None or far_list is None or self._local_list is None:
                raise NotConnectedError(f"not connected to {peer}: connect first")
            self._peers.move_to_end(peer)
            if not local_blocks:
                return TransferStats(0, 0.0, 0)
            self._writing[remote.agent_name] += 1
        try:
            check_range(local_blocks, self.layout.num_blocks, "source")
            check_range(remote_blocks, remote.layout.num_blocks, "destination")
            lists = (self._local_list, far_list)
            pairs = (indices(local_blocks, self.layout), indices(remote_blocks, remote.layout))
            deadline = started + timeout_s
            self._transfer(lists, pairs, remote, transfer_id, deadline, cancelled)
        finally:
            with self._lock:
                self._writing[remote.agent_name] -= 1
        layers = 1 if self.layout.order == BLOCK_MAJOR else self.layout.num_layers
        return TransferStats(
            bytes=len(local_blocks) * self.layout.block_bytes * self.layout.num_layers,
            seconds=time.monotonic() - started,
            descriptors=count_runs(local_blocks, remote_blocks) * layers,
        )

    def decline(
        self, peer: str, remote_blocks: list[int], transfer_id: str, timeout_s: float
    ) -> None:
        """A one-sided write that does not happen needs nothing from anyone."""
        return None

    def close(self) -> None:
        """Forget peers and deregister the cache."""
        with self._meeting:
            with self._lock:
                pump, self._pump = self._pump, None
                names = list(self._loaded)
                self._peers.clear()
            if pump is not None:
                pump.stop()
            self._unload(names)
            if self._local_list is not None:
                _quietly(self._local_list.release)
                self._local_list = None
            _quietly(self._agent.deregister_memory, self._registered, [UCX])

    def _unused(self) -> list[str]:
        """Loaded remote agents that no pair id refers to and no write uses: no write
        can start on them any more, so they are forgotten here at once."""
        with self._lock:
            used = {peer.agent_name for peer in self._peers.values()}
            unused = [n for n in self._loaded if n not in used and not self._writing[n]]
            for name in unused:
                del self._loaded[name]
                self._writing.pop(name, None)
        return unused

    def _unload(self, names: list[str]) -> None:
        """Remove remote agents from NIXL (with `_meeting` held). A prepared list that
        a running write still holds (a peer that restarted under its name) is left to
        that write: released when the last reference to it goes."""
        with self._lock:
            lists = [(self._remote_lists.pop(name, None), self._writing[name]) for name in names]
            for name in names:
                self._loaded.pop(name, None)
        for far, writing in lists:
            if far is not None and not writing:
                _quietly(far.release)
        for name in names:
            _quietly(self._agent.remove_remote_agent, name)

    def _prepare(
        self, agent: str, layout: KVLayout, base: int, memory: str, device_id: int
    ) -> nixl_prepped_dlist_handle:
        """NIXL's prepared list of every block of a cache (of every block of every
        layer, layer-major), indexed as `indices` numbers them."""
        rows = block_rows(layout, base, device_id)
        return self._agent.prep_xfer_dlist(agent, rows, memory, backends=[UCX])

    def _transfer(
        self,
        lists: tuple[nixl_prepped_dlist_handle, nixl_prepped_dlist_handle],
        pairs: tuple[Indices, Indices],
        remote: NixlPeer,
        transfer_id: str,
        deadline: float,
        cancelled: threading.Event | None,
    ) -> None:
        what = f"transfer {transfer_id} to {remote.agent_name}"
        handle: nixl_xfer_handle | None = None
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", lists[0], pairs[0], lists[1], pairs[1], backends=[UCX]
            )
            _check_going(deadline, cancelled, what)
            faults.blocking_point("kv_transfer.before_post")
            _finish(self._agent, handle, self._agent.transfer(handle), deadline, cancelled, what)
        except TransferError:
            raise
        except Exception as error:  # NIXL raises its own classes, all Exceptions
            raise TransferError(f"{what} failed: {error}") from error
        finally:
            if handle is not None:
                # Cancels whatever is still in flight after an error or timeout.
                _quietly(handle.release)


class _Pump:
    """Progresses the agent's UCX worker every few milliseconds, in a thread of its
    own, so that a peer's connection requests are answered while this side is idle."""

    def __init__(self, agent: nixl_agent, period_s: float = _PUMP_PERIOD_S) -> None:
        self._agent = agent
        self._period_s = period_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop pumping (returns once the thread has ended)."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            try:
                # Without a progress thread, fetching notifications progresses the
                # worker; this agent sends none, so nothing is lost.
                self._agent.get_new_notifs()
            except Exception as error:  # NIXL raises its own classes, all Exceptions
                log.warning("NIXL progress failed: %s", error)


def memory_kind(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory kind and device id for a tensor (DRAM has device id 0)."""
    if kv_cache.device.type == "cuda":
        return "VRAM", kv_cache.device.index or 0
    if kv_cache.device.type == "cpu":
        return "DRAM", 0
    raise ValueError(f"NIXL cannot register memory on device {kv_cache.device}")


def descriptors(
    merged: Sequence[Segment], layout: KVLayout, base: int, device_id: int, side: str
) -> list[tuple[int, int, int]]:
    """(address, length, device id) on the `side` ("src" or "dst") of each segment:
    one per segment in a block-major cache (all its layers lie together), else one per
    segment of each layer, layers outer. Plain Python: for the tens of segments of a
    sequence it is faster than numpy's per-call costs."""
    stride = layout.block_stride  # computed properties: read them once
    if layout.order == BLOCK_MAJOR:
        return [(base + getattr(s, side) * stride, s.count * stride, device_id) for s in merged]
    block_bytes, layer_stride = layout.block_bytes, layout.layer_stride
    pieces = [(getattr(s, side) * stride, s.count * block_bytes) for s in merged]
    return [
        (base + layer * layer_stride + offset, length, device_id)
        for layer in range(layout.num_layers)
        for offset, length in pieces
    ]


def block_rows(layout: KVLayout, base: int, device_id: int) -> npt.NDArray[np.uint64]:
    """(address, length, device id) of every block of a cache, the rows of its
    prepared list: one per block, all its layers (block-major), else one per block of
    each layer, layers outer."""
    blocks = np.arange(layout.num_blocks, dtype=np.uint64) * np.uint64(layout.block_stride)
    if layout.order == BLOCK_MAJOR:
        starts, length = blocks, layout.block_stride
    else:
        layers = np.arange(layout.num_layers, dtype=np.uint64) * np.uint64(layout.layer_stride)
        starts, length = (layers[:, None] + blocks[None, :]).ravel(), layout.block_bytes
    rows = np.empty((starts.size, 3), dtype=np.uint64)
    rows[:, 0] = starts + np.uint64(base)
    rows[:, 1] = length
    rows[:, 2] = device_id
    return rows


def indices(blocks: list[int], layout: KVLayout) -> Indices:
    """The rows of `block_rows` that hold `blocks`, in the order of the blocks (layer
    by layer, layer-major); pairing two such lists position by position pairs the
    same layer of the same position on both sides."""
    if layout.order == BLOCK_MAJOR:
        return blocks  # NIXL takes the ids as they are: no copy here
    layers = np.arange(layout.num_layers, dtype=np.int64) * layout.num_blocks
    ids = np.asarray(blocks, dtype=np.int64)
    return (layers[:, None] + ids[None, :]).ravel().astype(np.int32)


def check_range(blocks: list[int], num_blocks: int, side: str) -> None:
    """ValueError when an id lies outside a cache of `num_blocks` blocks (its ends
    tell, at C speed; the full check names the culprits)."""
    if min(blocks) < 0 or max(blocks) >= num_blocks:
        check_blocks(blocks, num_blocks, side)


# Above this many blocks numpy counts runs faster than Python's iterators do.
_NUMPY_FROM_BLOCKS = 128


def count_runs(src: list[int], dst: list[int]) -> int:
    """Segments of a transfer: runs consecutive on both sides (what NIXL merges into
    one copy each)."""
    if not src:
        return 0
    if len(src) > _NUMPY_FROM_BLOCKS:
        both = np.asarray([src, dst], dtype=np.int64)
        return 1 + int(np.count_nonzero((np.diff(both, axis=1) != 1).any(axis=0)))
    next_one = (1).__ne__  # a step other than +1 starts a new run
    src_breaks = map(next_one, map(operator.sub, src[1:], src))
    dst_breaks = map(next_one, map(operator.sub, dst[1:], dst))
    breaks: int = sum(map(operator.or_, src_breaks, dst_breaks))
    return 1 + breaks


def _check_going(deadline: float, cancelled: threading.Event | None, what: str) -> None:
    """TransferError if the write was cancelled or its deadline passed."""
    if cancelled is not None and cancelled.is_set():
        raise TransferError(f"{what} was cancelled")
    seconds_left(deadline, what)


def _finish(
    agent: nixl_agent,
    handle: nixl_xfer_handle,
    state: str,
    deadline: float,
    cancelled: threading.Event | None,
    what: str,
) -> None:
    """Poll a posted request until it is done; TransferError on error, cancel or
    deadline (the caller then releases the request, which stops it)."""
    polls = 0
    sleep_s = 1e-5
    while state == "PROC":
        _check_going(deadline, cancelled, what)
        polls += 1
        if polls > _SPIN_POLLS:
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _MAX_SLEEP_S)
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise TransferError(f"{what} failed: NIXL reported {state}")


def _quietly(call: Any, *args: Any) -> None:
    """Clean-up that must not mask the error being raised."""
    try:
        call(*args)
    except Exception as error:  # NIXL raises its own classes, all Exceptions
        log.warning("NIXL clean-up %s failed: %s", getattr(call, "__name__", call), error)
