"""KV transfer agents in processes of their own, driven over a pipe.

Each process holds one agent over a random KV cache and runs the commands it is sent,
one at a time, answering each: the test plays the part the workers' HTTP hand-off
plays in production (carrying metadata, block ids and the order of calls).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CacheSpec:
    """The shape and type of a test KV cache."""

    num_layers: int = 3
    num_blocks: int = 24
    block_size: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float32"
    model: str = "test-model"
    weights: str = "0123456789abcdef"
    max_peers: int = 128  # connections the agent keeps
    block_major: bool = False  # stored blocks outermost, as the engine's cache


class AgentCallError(Exception):
    """An agent method raised in its process; `kind` is the exception class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class AgentProcess:
    """The parent's handle on an agent process."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self._started = False

    def send(self, command: str, *args: Any) -> None:
        """Start a command; its answer comes with `receive`."""
        self.conn.send((command, args))

    def receive(self, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """The answer of the oldest command sent; AgentCallError if it raised."""
        if not self._started:
            self._started = True
            # The agent is built: a new interpreter imports torch and NIXL, which takes
            # minutes on a machine loaded many times over, not a command's timeout.
            self.receive(START_TIMEOUT_S)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"no answer from the agent process within {timeout_s}s")
        status, value = self.conn.recv()
        if status == "error":
            raise AgentCallError(*value)
        return value

    def call(self, command: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """Run a command and return its answer."""
        self.send(command, *args)
        return self.receive(timeout_s)

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, as a crashed worker does."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        """Ask the process to close its agent and exit; kill it if it does not."""
        if self.process.is_alive():
            with suppress(AgentCallError, TimeoutError, OSError, EOFError):
                self.call("exit", timeout_s=10)
            self.process.join(10)
        self.kill()


@contextmanager
def agent_process(
    backend: str,
    name: str,
    spec: CacheSpec = CacheSpec(),
    seed: int = 0,
    log_path: str | None = None,
) -> Iterator[AgentProcess]:
    """An agent of `backend` in a spawned process, its cache filled from `seed`
    (returned at once: the first call waits for the agent to be built). With
    `log_path`, the process's stdout and stderr (UCX's logs) go to that file."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    args = (child, backend, name, spec, seed, log_path)
    process = context.Process(target=serve, args=args, daemon=True)
    process.start()
    child.close()
    agent = AgentProcess(process, parent)
    try:
        yield agent
    finally:
        agent.stop()


def serve(
    conn: Connection, backend: str, name: str, spec: CacheSpec, seed: int, log_path: str | None
) -> None:
    """The agent process: build the agent, then run commands until `exit`."""
    if log_path is not None:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), sys.stdout.fileno())
            os.dup2(log.fileno(), sys.stderr.fileno())
    # Tests stay on loopback, and share two cores with everything else.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import torch

    from pdserve.workers.kv_transfer.factory import create_agent
    from pdserve.workers.kv_transfer.layout import KVLayout

    torch.set_num_threads(1)
    shape = [spec.num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim]
    if not spec.block_major:
        shape[:2] = shape[1::-1]
    generator = torch.Generator().manual_seed(seed)
    cache = torch.rand(shape, generator=generator).to(getattr(torch, spec.dtype))
    if spec.block_major:
        cache = cache.transpose(0, 1)  # indexed [layer, block, ...] either way
    layout = KVLayout.of(cache, model=spec.model, weights=spec.weights)
    agent = create_agent(backend, name, cache, layout, max_peers=spec.max_peers)
    commands = _commands(agent, cache)
    conn.send(("ok", None))
    while True:
        command, args = conn.recv()
        try:
            answer = ("ok", commands[command](*args))
        except Exception as error:
            answer = ("error", (type(error).__name__, f"{error}\n{traceback.format_exc()}"))
        conn.send(answer)
        if command == "exit":
            return


def _commands(agent: Any, cache: Any) -> dict[str, Callable[..., Any]]:
    pending: dict[str, Any] = {}

    def expect(peer: str, blocks: list[int], transfer_id: str) -> None:
        pending[transfer_id] = agent.expect(peer, blocks, transfer_id)

    def wait(transfer_id: str, timeout_s: float) -> float:
        pending.pop(transfer_id).wait(timeout_s)
        return time.monotonic()  # one clock for all processes of the machine

    def write(
        peer: str, local: list[int], remote: list[int], transfer_id: str, timeout_s: float
    ) -> dict[str, Any]:
        started = time.monotonic()
        stats = agent.write(peer, local, remote, transfer_id, timeout_s)
        return {
            "bytes": stats.bytes,
            "seconds": stats.seconds,
            "descriptors": stats.descriptors,
            "started": started,
            "finished": time.monotonic(),
        }

    def raw_write(pid: int, base: int, local: list[int], remote: list[int]) -> float:
        """Seconds of process_vm_writev copying the blocks into process `pid`'s cache
        at `base`, with the descriptors NIXL is given (computed beforehand: this is
        the copy alone, the best two processes can do)."""
        from pdserve.workers.kv_transfer.layout import segments
        from pdserve.workers.kv_transfer.nixl import descriptors
        from support.vm_copy import write_into

        merged = segments(local, remote)
        ours = descriptors(merged, agent.layout, cache.data_ptr(), 0, "src")
        theirs = descriptors(merged, agent.layout, base, 0, "dst")
        pieces = [(a, b, n) for (a, n, _), (b, _, _) in zip(ours, theirs, strict=True)]
        started = time.perf_counter()
        write_into(pid, pieces)
        return time.perf_counter() - started

    def checksum(blocks: list[int]) -> float:
        return float(cache[:, blocks].double().sum())

    def close() -> None:
        agent.close()

    return {
        "metadata": agent.metadata,
        "accept": agent.accept,
        "connect": agent.connect,
        "expect": expect,
        "wait": wait,
        "withdraw": lambda transfer_id, timeout_s: pending.pop(transfer_id).withdraw(timeout_s),
        "write": write,
        "decline": agent.decline,
        "disconnect": agent.disconnect,
        "peers": agent.num_peers,
        "cache": lambda: cache.clone(),
        "checksum": checksum,
        "raw_write": raw_write,
        "pid": os.getpid,
        "memcpy": memcpy_seconds,
        "exit": close,
    }


_buffers: dict[int, tuple[Any, Any]] = {}


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """Median seconds of torch's copy_ of `nbytes` between two buffers allocated and
    touched beforehand, and kept for the next call of the same size (the baseline a
    transfer is compared with)."""
    import torch

    if nbytes not in _buffers:
        _buffers.clear()  # one size at a time: the largest are 256 MiB each
        pair = (torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8))
        _buffers[nbytes] = pair
    src, dst = _buffers[nbytes]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
