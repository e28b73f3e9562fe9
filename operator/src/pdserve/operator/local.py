"""`pdserve local -f pool.yaml`: a ServingPool run as processes on this machine.

The local backend realises the plan the operator renders for a cluster: the same
`pdserve worker` and `pdserve router` command lines (`render.worker_args`,
`render.router_args`, `render.routing_table`), wired for one machine: loopback
addresses, ports the system picks at bind time, a credential made for the run, the
prefill workers' URLs as the decode workers' peers (in a file written once they have
bound their ports) and as the router's static discovery. The workers start together,
the router once they are ready.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import yaml

from pdserve.cli.credentials import write_new_credential
from pdserve.cli.ports import announce_port
from pdserve.cli.process import ServerProcess, spawn, stop_all
from pdserve.operator import api, render

CREDENTIAL_FILE = "credential"
ROUTING_FILE = "routing.json"
PEERS_FILE = "prefill-peers"
LOOPBACK = "127.0.0.1"


class LocalPoolError(RuntimeError):
    """The pool could not be started, or one of its processes died."""


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader never sees part of it."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


def load_manifest(path: Path) -> api.ServingPool:
    """A ServingPool from a YAML file; InvalidPoolError names every bad field."""
    try:
        manifest = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise LocalPoolError(f"cannot read {path}: {error}") from error
    if not isinstance(manifest, dict):
        raise LocalPoolError(f"{path}: not a ServingPool manifest")
    return api.parse_pool(manifest)


def with_model_path(pool: api.ServingPool, model_dir: Path) -> api.ServingPool:
    """The pool serving the checkpoint at `model_dir` (the manifest's path is where
    the model lies in the cluster's containers)."""
    model = pool.spec.model.model_copy(update={"path": str(model_dir)})
    return pool.model_copy(update={"spec": pool.spec.model_copy(update={"model": model})})


class LocalPool:
    """A pool's router and workers as child processes; stop() ends them all."""

    def __init__(
        self,
        pool: api.ServingPool,
        run_dir: Path,
        *,
        host: str = LOOPBACK,
        router_port: int = 0,
        api_key_file: Path | None = None,
        env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.pool = pool
        self.run_dir = run_dir
        self.host = host
        self.router_port = router_port
        self.api_key_file = api_key_file
        self._env = env or {}  # extra environment per role (prefill, decode, router)
        self.workers: dict[api.Role, list[ServerProcess]] = {"prefill": [], "decode": []}
        self.router: ServerProcess | None = None
        self.credential_file = run_dir / CREDENTIAL_FILE
        self.routing_file = run_dir / ROUTING_FILE
        self.peers_file = run_dir / PEERS_FILE

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.pool.metadata.name

    @property
    def processes(self) -> list[ServerProcess]:
        """Every process started, the router first."""
        started = [self.router] if self.router is not None else []
        return started + self.workers["decode"] + self.workers["prefill"]

    @property
    def url(self) -> str:
        """The router's URL."""
        assert self.router is not None, "the pool is not started"
        return self.router.url

    def start(self, timeout_s: float = 300.0) -> str:
        """Start the workers and the router, wait until all are ready; the router's URL.
        All workers start at once; the decode workers learn the prefill workers' URLs
        from a file written as soon as those have bound their ports."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_new_credential(self.credential_file)
        self.peers_file.unlink(missing_ok=True)
        counts = render.desired_replicas(self.pool.spec)
        try:
            for role in render.ROLES:
                self._start_role(role, counts[role])
            peers = "".join(f"{w.url}\n" for w in self.workers["prefill"])
            _write_atomically(self.peers_file, peers)
            for worker in self.workers["prefill"] + self.workers["decode"]:
                worker.wait_ready(timeout_s)
            self._start_router(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start_role(self, role: api.Role, count: int) -> None:
        wiring = render.Wiring(
            host=self.host,
            port=0,
            credential_file=str(self.credential_file),
            prefill_peers_file=str(self.peers_file),
        )
        args = render.worker_args(self.name, self.pool.spec, role, wiring) if count else []
        for index in range(count):
            log = self.run_dir / "logs" / f"{role}-{index}.log"
            self.workers[role].append(spawn(args, log, self.host, self._env.get(role)))

    def _start_router(self, timeout_s: float) -> None:
        discovery = {
            "kind": "static",
            "decode": [w.url for w in self.workers["decode"]],
            "prefill": [w.url for w in self.workers["prefill"]],
        }
        table = render.routing_table(self.name, "local", self.pool.spec, discovery)
        self.routing_file.write_text(render.routing_json(table))
        keys = str(self.api_key_file) if self.api_key_file is not None else None
        wiring = render.Wiring(
            self.host, self.router_port, str(self.credential_file), api_key_file=keys
        )
        args = render.router_args(str(self.routing_file), wiring)
        log = self.run_dir / "logs" / "router.log"
        self.router = spawn(args, log, self.host, self._env.get("router"))
        self.router.wait_ready(timeout_s)

    def exited(self) -> list[ServerProcess]:
        """The processes of the pool that have exited."""
        return [process for process in self.processes if not process.running()]

    def stop(self) -> None:
        """Stop the router, then the workers."""
        if self.router is not None:
            self.router.stop()
        stop_all(self.workers["decode"] + self.workers["prefill"])

    def __enter__(self) -> LocalPool:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


def serve(
    manifest: Path,
    model_dir: Path | None,
    host: str,
    port: int,
    port_file: Path | None,
    run_dir: Path | None,
    api_key_file: Path | None = None,
) -> int:
    """Run a pool until Ctrl-C (or SIGTERM); the exit code."""
    try:
        pool = load_manifest(manifest)
    except (LocalPoolError, api.InvalidPoolError) as error:
        print(f"pdserve local: {error}", file=sys.stderr)
        return 2
    if model_dir is not None:
        pool = with_model_path(pool, model_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    folder = run_dir or Path(tempfile.mkdtemp(prefix=f"pdserve-{pool.metadata.name}-"))
    local = LocalPool(pool, folder, host=host, router_port=port, api_key_file=api_key_file)
    print(f"pool {local.name}: starting its workers (logs in {folder / 'logs'})", flush=True)
    try:
        url = local.start()
    except (RuntimeError, TimeoutError) as error:
        print(f"pdserve local: the pool did not start: {error}", file=sys.stderr)
        return 1
    try:
        if port_file is not None:
            announce_port(port_file, int(url.rsplit(":", 1)[1]))
        print(f"pool {local.name}: serving model {pool.spec.model.name} at {url}", flush=True)
        print("Ctrl-C stops it", flush=True)
        return _wait(local, stop)
    finally:
        local.stop()
        print(f"pool {local.name}: stopped", flush=True)


def _wait(local: LocalPool, stop: threading.Event) -> int:
    """Serve until stopped. A worker that dies is reported (the router routes around
    it, as in a cluster, where it would be restarted); the router dying ends the run."""
    reported: set[int] = set()
    while not stop.wait(0.5):
        for dead in local.exited():
            if dead.process.pid in reported:
                continue
            reported.add(dead.process.pid)
            tail = "\n".join(dead.log().splitlines()[-20:])
            print(
                f"pdserve local: {dead.log_path.stem} exited with status "
                f"{dead.process.returncode}:\n{tail}",
                file=sys.stderr,
                flush=True,
            )
            if dead is local.router:
                return 1
    return 0
