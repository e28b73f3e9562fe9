"""The torch.distributed plumbing of one prefill/decode pair: a 2-rank process group
of its own (gloo on CPU, NCCL on CUDA) met through a store the decode side hosts, and
the sends and receives in flight on it.

Groups are built directly, not through the global default group, so one process can
hold a group per peer. The decode side is rank 0, the prefill side rank 1.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol, cast

import torch
from torch._C import _distributed_c10d as c10d
from torch._C._distributed_c10d import Store, TCPStore, Work

from pdserve.workers.kv_transfer.base import TransferError, seconds_left

DECODE_RANK = 0
PREFILL_RANK = 1
# NCCL's own watchdog timeout: far beyond any transfer's deadline, since each
# transfer aborts the group itself when it runs out of time.
_NCCL_WATCHDOG = timedelta(minutes=30)
_POLL_S = 0.0005


class Group(Protocol):
    """The point-to-point part of a gloo or NCCL process group (missing from torch's
    type stubs of the backends)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Work: ...

    def abort(self) -> None: ...


class StoreServer:
    """A TCPStore on `host`, on a free port; the meeting point of all pairs."""

    def __init__(self, host: str, timeout_s: float = 60.0) -> None:
        # The store listens on a socket bound here, so it is reachable on `host` only.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self._socket.listen(128)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self.store = TCPStore(
            host,
            self.port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=self._socket.fileno(),
        )

    def close(self) -> None:
        """Stop listening (the store itself goes with its last reference)."""
        self._socket.close()


def store_client(host: str, port: int, timeout_s: float) -> Store:
    """A client of a peer's store; TransferError when it cannot be reached in time."""
    timeout = _timeout(timeout_s)
    try:
        return TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    except (RuntimeError, ValueError) as error:  # DistError is a RuntimeError
        raise TransferError(
            f"cannot reach the decode worker's store {host}:{port}: {error}"
        ) from error


class Pair:
    """One peer's process group and the transfers in flight on it, by transfer id.

    Closing the pair drops the group and every pending send and receive, which closes
    its connections, so no byte of a dropped receive lands in the cache afterwards;
    the next hand-off meets afresh. Whether one failed transfer closes the pair is the
    agent's decision (see torch_dist.py).
    """

    def __init__(self, group: Group, kind: str, rank: int, store: Store) -> None:
        self.kind = kind
        self.rank = rank
        self._group: Group | None = group
        self._store = store
        self._lock = threading.Lock()
        self._works: dict[str, list[Work]] = {}
        # NCCL ignores tags and matches a pair's messages in posting order: the
        # receiver numbers its transfers, the sender posts them in that order.
        self._posted = 0
        self._turn = threading.Condition()
        self._sent = 0

    @property
    def closed(self) -> bool:
        """Whether the group was dropped."""
        return self._group is None

    @property
    def busy(self) -> bool:
        """Whether transfers are in flight on the pair."""
        with self._lock:
            return bool(self._works)

    def post_recvs(self, transfer_id: str, tensors: Sequence[torch.Tensor], tag: int) -> None:
        """Post a receive into each tensor (views of the cache, received in place)."""
        with self._lock:
            group = self._live_group(transfer_id)
            works = [group.recv([tensor], 1 - self.rank, tag) for tensor in tensors]
            self._works[transfer_id] = works
            order = self._posted
            self._posted += 1
        if self.kind == "nccl":
            self._store.set(f"order/{transfer_id}", str(order))

    def post_sends(
        self, transfer_id: str, tensors: Sequence[torch.Tensor], tag: int, deadline: float
    ) -> None:
        """Post a send of each tensor, in the receiver's order where the backend needs."""
        if self.kind == "nccl":
            self._await_turn(transfer_id, deadline)
        try:
            with self._lock:
                group = self._live_group(transfer_id)
                works = [group.send([tensor], 1 - self.rank, tag) for tensor in tensors]
                self._works[transfer_id] = works
        finally:
            if self.kind == "nccl":
                with self._turn:
                    self._sent += 1
                    self._turn.notify_all()

    def wait(self, transfer_id: str, deadline: float, what: str) -> None:
        """Wait for a transfer's sends or receives; TransferError on failure or at the
        deadline (the caller then closes the pair)."""
        works = self._works.get(transfer_id)
        if works is None:
            raise TransferError(f"{what}: the connection was dropped")
        try:
            if self.kind == "nccl":
                _poll(works, deadline, what)
            else:
                _wait_gloo(works, deadline, what)
        finally:
            with self._lock:
                self._works.pop(transfer_id, None)

    def close(self) -> None:
        """Drop the group and everything pending on it; never raises."""
        with self._lock:
            group, self._group = self._group, None
            self._works.clear()
        with self._turn:
            self._turn.notify_all()
        if group is not None and self.kind == "nccl":
            # NCCL operations cannot be withdrawn one by one; aborting the
            # communicator ends them all.
            with contextlib.suppress(RuntimeError):
                group.abort()
        del group

    def _live_group(self, transfer_id: str) -> Group:
        if self._group is None:
            raise TransferError(f"transfer {transfer_id}: the connection was dropped")
        return self._group

    def _await_turn(self, transfer_id: str, deadline: float) -> None:
        key = f"order/{transfer_id}"
        what = f"transfer {transfer_id}"
        timeout = _timeout(seconds_left(deadline, what))
        try:
            self._store.wait([key], timeout)
            order = int(self._store.get(key))
            self._store.delete_key(key)  # one key per transfer: do not let them pile up
        except RuntimeError as error:
            raise TransferError(f"transfer {transfer_id} was never expected: {error}") from error
        with self._turn:
            ready = self._turn.wait_for(
                lambda: self._sent >= order or self.closed,
                timeout=seconds_left(deadline, what),
            )
        if self.closed:
            raise TransferError(f"transfer {transfer_id}: the connection was dropped")
        if not ready:
            raise TransferError(f"transfer {transfer_id}: earlier transfers never came")


def open_group(
    kind: str, store: Store, rank: int, timeout_s: float, host: str, device: torch.device
) -> Group:
    """Build this side of a pair's group; blocks until the other side has joined.
    TransferError when it has not within `timeout_s`."""
    timeout = _timeout(timeout_s)
    try:
        if kind == "gloo":
            # The full options (not in the type stubs) bind gloo to `host`.
            options = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._devices = [c10d.ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timeout
            return cast(Group, c10d.ProcessGroupGloo(store, rank, 2, options))
        return _open_nccl(store, rank, timeout_s, device)
    except (RuntimeError, ValueError) as error:  # DistError is a RuntimeError
        raise TransferError(f"the peer did not join within {timeout_s:.1f}s: {error}") from error


def _open_nccl(store: Store, rank: int, timeout_s: float, device: torch.device) -> Group:
    options = c10d.ProcessGroupNCCL.Options()
    options._timeout = _NCCL_WATCHDOG
    group = cast(Group, c10d.ProcessGroupNCCL(store, rank, 2, options))
    # NCCL meets its peer lazily, at the first operation: one small message now makes
    # `accept` return only once the prefill side has truly joined.
    probe = torch.zeros(1, device=device)
    op = group.send if rank == PREFILL_RANK else group.recv
    work = op([probe], 1 - rank, 0)
    try:
        _poll([work], time.monotonic() + timeout_s, "NCCL handshake")
    except TransferError:
        group.abort()
        raise
    return group


def _timeout(seconds: float) -> timedelta:
    """A c10d timeout of `seconds` > 0: c10d reads a zero timeout as "none", so a spent
    budget is refused here instead (TransferError)."""
    if not seconds > 0:
        raise TransferError(f"no time left (a timeout of {seconds:.3f}s)")
    return timedelta(seconds=seconds)


def _wait_gloo(works: Sequence[Work], deadline: float, what: str) -> None:
    for work in works:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(f"{what} did not finish before its deadline")
        try:
            work.wait(_timeout(remaining))
        except RuntimeError as error:  # gloo's timeouts and closed connections
            raise TransferError(f"{what} failed: {error}") from error


def _poll(works: Sequence[Work], deadline: float, what: str) -> None:
    """Wait for NCCL works without blocking in the driver: a dead peer must cost a
    deadline, not a hang."""
    pending = list(works)
    while pending:
        try:
            pending = [work for work in pending if not work.is_completed()]
        except RuntimeError as error:
            raise TransferError(f"{what} failed: {error}") from error
        if pending and time.monotonic() > deadline:
            raise TransferError(f"{what} did not finish before its deadline")
        if pending:
            time.sleep(_POLL_S)
    for work in works:
        try:
            work.wait()  # orders the current stream after the copies
        except RuntimeError as error:
            raise TransferError(f"{what} failed: {error}") from error
