"""`pdserve local -f pool.yaml`: a ServingPool run as processes on this machine.

The local backend realises the plan the operator renders for a cluster: the same
`pdserve worker` and `pdserve router` command lines (`render.worker_args`,
`render.router_args`, `render.routing_table`), wired for one machine: loopback
addresses, ports the system picks at bind time, a credential made for the run, the
prefill workers' URLs as the decode workers' peers (in a file written once they have
bound their ports) and as the router's static discovery. The workers start together,
the router once they are ready.

Scaling (`scale`, driven by the planner in local/scaling.py): a new worker joins the
router's table once ready (a prefill worker joins the decode workers' peers first); a
worker leaves the table first, and once the router has let it go it is told to stop,
which it does after draining its requests and hand-offs in flight.

Revisions (driven by local/rollout.py): every worker runs a revision of its role (its
`--revision`, named from what it runs); a rollout starts and stops the workers of each
revision (`add`, `remove`) and sets the routing table's weights between them.

local/main.py runs the pool, its scaling and its rollouts together; this module imports
none of them (they build on it).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

import yaml

from pdserve.base.credentials import write_new_credential
from pdserve.base.process import ServerProcess, spawn, stop_all
from pdserve.operator import api, render
from pdserve.operator.rollout.revision import revision_name
from pdserve.operator.scaling import planner
from pdserve.protocol.routing import RevisionWeight

CREDENTIAL_FILE = "credential"
ROUTING_FILE = "routing.json"
PEERS_FILE = "prefill-peers"
LOOPBACK = "127.0.0.1"
# Beyond a worker's drain time: its engine stopping and the process exiting.
EXIT_MARGIN_S = 10.0


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


def role_revision(pool: api.ServingPool, role: api.Role) -> str:
    """The revision of `role` that `pool`'s spec describes: a digest of its workers'
    command line (wired alike for every worker, so only the spec counts), environment
    and resources; never of how many run."""
    workers = pool.spec.pool(role)
    assert workers is not None, f"no {role} pool"
    wiring = render.Wiring(host=LOOPBACK, port=0, credential_file=CREDENTIAL_FILE)
    args = render.worker_args(pool.metadata.name, pool.spec, role, wiring)
    content = {
        "args": _without_revision(args),
        "env": [api.dump(var) for var in workers.env],
        "resources": api.dump(workers.resources),
    }
    return revision_name(role, content)


def _without_revision(args: list[str]) -> list[str]:
    """A worker's arguments less `--revision NAME`."""
    if "--revision" not in args:
        return args
    at = args.index("--revision")
    return args[:at] + args[at + 2 :]


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
        # Called with every process's host:port whenever workers come or go.
        self.on_targets: Callable[[list[str]], None] | None = None
        self._lock = threading.Lock()  # the worker lists: the scaler changes them
        self._spawned: dict[api.Role, int] = {"prefill": 0, "decode": 0}
        self._gone: list[ServerProcess] = []  # exited workers, taken off the lists
        # Each role's revisions: the spec each runs, each worker's (by pid), and the
        # routing table's split (empty: none, every worker of the role takes traffic).
        self.specs: dict[str, api.ServingPoolSpec] = {}
        self.stable: dict[api.Role, str] = {}
        for role in render.ROLES:
            if pool.spec.pool(role) is not None:
                self.stable[role] = role_revision(pool, role)
                self.specs[self.stable[role]] = pool.spec
        self._revision_of: dict[int, str] = {}
        self.weights: dict[api.Role, tuple[RevisionWeight, ...]] = {"prefill": (), "decode": ()}
        self.rolling: set[api.Role] = set()  # roles in a rollout: scaling leaves them be
        self.extra_targets: list[str] = []  # host:port of the pool's own metrics, if served

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.pool.metadata.name

    @property
    def processes(self) -> list[ServerProcess]:
        """Every process started, the router first."""
        started = [self.router] if self.router is not None else []
        with self._lock:
            return started + self.workers["decode"] + self.workers["prefill"] + self._gone

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
            self._write_peers()
            for worker in self.workers["prefill"] + self.workers["decode"]:
                worker.wait_ready(timeout_s)
            self._start_router(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start_role(self, role: api.Role, count: int) -> None:
        for _ in range(count):
            self.workers[role].append(self._spawn(role))

    def _spawn(self, role: api.Role, revision: str | None = None) -> ServerProcess:
        """Start one more `role` worker of `revision` (default: the stable one; not
        waiting for it)."""
        wiring = render.Wiring(
            host=self.host,
            port=0,
            credential_file=str(self.credential_file),
            prefill_peers_file=str(self.peers_file),
        )
        revision = revision or self.stable[role]
        args = render.worker_args(self.name, self.specs[revision], role, wiring)
        args = [*_without_revision(args), "--revision", revision]
        log = self.run_dir / "logs" / f"{role}-{self._spawned[role]}.log"
        self._spawned[role] += 1
        worker = spawn(args, log, self.host, self._env.get(role))
        self._revision_of[worker.process.pid] = revision
        return worker

    def revision_of(self, worker: ServerProcess) -> str:
        """The revision a worker runs."""
        return self._revision_of.get(worker.process.pid, "")

    def of_revision(self, role: api.Role, revision: str) -> list[ServerProcess]:
        """The live workers of `role` that run `revision`, oldest first."""
        with self._lock:
            return [w for w in self.workers[role] if self.revision_of(w) == revision]

    def _write_peers(self) -> None:
        """The prefill workers' URLs, for the decode workers' allow-list."""
        with self._lock:
            peers = "".join(f"{w.url}\n" for w in self.workers["prefill"])
        _write_atomically(self.peers_file, peers)

    def _write_routing(self, leaving: ServerProcess | None = None) -> None:
        """The routing file naming every worker but `leaving`."""
        with self._lock:
            named = {
                role: [w.url for w in workers if w is not leaving]
                for role, workers in self.workers.items()
            }
        discovery = {"kind": "static", "decode": named["decode"], "prefill": named["prefill"]}
        table = render.routing_table(self.name, "local", self.pool.spec, discovery)
        split = {"prefill": self.weights["prefill"], "decode": self.weights["decode"]}
        revisions = table.revisions.model_copy(update=split)
        table = table.model_copy(update={"revisions": revisions})
        _write_atomically(self.routing_file, render.routing_json(table))

    def _start_router(self, timeout_s: float) -> None:
        self._write_routing()
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
        with self._lock:
            workers = self.workers["decode"] + self.workers["prefill"]
        stop_all(workers)

    # -- scaling --------------------------------------------------------------------------

    def replicas(self) -> dict[api.Role, planner.Replicas]:
        """Each role's live workers (a worker that exited is no replica, as a pod that
        died is none), and how many of them are ready (in the router's table)."""
        self._reap()
        with self._lock:
            return {
                role: planner.Replicas(len(workers), sum(w.running() for w in workers))
                for role, workers in self.workers.items()
                if self.pool.spec.pool(role) is not None
            }

    def targets(self) -> list[str]:
        """host:port of every live process, for Prometheus."""
        live = [f"{p.host}:{p.port}" for p in self.processes if p.running() and p.port]
        return live + self.extra_targets

    def scale(self, role: api.Role, count: int, timeout_s: float = 300.0) -> None:
        """Start or stop `role` workers until `count` run (blocks until done). A pool
        with disaggregated buckets keeps one prefill worker: the router's static table
        refuses such buckets without one."""
        if role == "prefill" and self.pool.spec.routing.disaggregated:
            count = max(count, 1)
        if role in self.rolling:
            return
        self._reap()
        while len(self.workers[role]) < count:
            self._add(role, timeout_s)
        while len(self.workers[role]) > count:
            self._remove(role, timeout_s)

    def _reap(self) -> None:
        """Take exited workers off the lists (they stay in `processes`, for reports)."""
        with self._lock:
            for role, workers in self.workers.items():
                dead = [w for w in workers if not w.running()]
                self.workers[role] = [w for w in workers if w.running()]
                self._gone += dead

    def rewrite_routing(self) -> None:
        """The routing file again, from the pool's spec as it is now."""
        self._write_routing()

    def set_weights(self, role: api.Role, weights: tuple[RevisionWeight, ...]) -> None:
        """Split `role`'s traffic between its revisions (empty: no split), in the
        routing table the router re-reads."""
        self.weights[role] = weights
        self._write_routing()

    def add(self, role: api.Role, revision: str, timeout_s: float = 300.0) -> None:
        """One more worker of `revision`, once ready known to the router."""
        self._add(role, timeout_s, revision)

    def remove(self, role: api.Role, revision: str, timeout_s: float = 300.0) -> None:
        """The newest worker of `revision` leaves the router's table, then drains."""
        workers = self.of_revision(role, revision)
        if workers:
            self._remove(role, timeout_s, workers[-1])

    def _add(self, role: api.Role, timeout_s: float, revision: str | None = None) -> None:
        """A new worker, ready, then known to the decode workers and the router."""
        worker = self._spawn(role, revision)
        try:
            worker.wait_ready(timeout_s)
        except BaseException:
            worker.stop()
            raise
        with self._lock:
            self.workers[role].append(worker)
        if role == "prefill":
            self._write_peers()  # before the router may name it in a hand-off
        self._write_routing()
        self._router_knows(worker.url, True, timeout_s)
        self._targets_changed()

    def _remove(
        self, role: api.Role, timeout_s: float, worker: ServerProcess | None = None
    ) -> None:
        """A worker (default: the newest) leaves the router's table; once the router
        has let it go it is told to stop, and drains before it exits."""
        with self._lock:
            worker = worker or self.workers[role][-1]
        self._write_routing(leaving=worker)
        self._router_knows(worker.url, False, timeout_s)
        with self._lock:
            self.workers[role] = [w for w in self.workers[role] if w is not worker]
        if role == "prefill":
            self._write_peers()
        workers = self.specs[self.revision_of(worker) or self.stable[role]].pool(role)
        drain_s = workers.drain_seconds if workers is not None else 0
        worker.stop(timeout_s=drain_s + EXIT_MARGIN_S)
        self._targets_changed()

    def _router_knows(self, url: str, known: bool, timeout_s: float) -> None:
        """Wait until the router's table holds `url` (or no longer does)."""
        if self.router is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.router.url}/workers", timeout=5) as answer:
                    listed = json.load(answer)
            except OSError:
                listed = {}
            urls = {w["url"] for role in listed.values() for w in role}
            if (url in urls) == known:
                return
            time.sleep(0.1)
        state = "take in" if known else "let go of"
        raise LocalPoolError(f"the router did not {state} {url} in {timeout_s:g}s")

    def _targets_changed(self) -> None:
        if self.on_targets is not None:
            self.on_targets(self.targets())

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
