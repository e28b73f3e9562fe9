"""`pdserve local -f pool.yaml`: a ServingPool's processes (local/pool.py), the
planner's rounds over them (local/scaling.py) and the rollouts of the manifest's edits
(local/rollout.py), run together until Ctrl-C. Above those three: none imports it."""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.base.ports import PortInUseError, announce_port, check_port_free
from pdserve.operator import api
from pdserve.operator.local.pool import LocalPool, LocalPoolError, load_manifest, with_model_path
from pdserve.operator.local.promserver import PrometheusServer
from pdserve.operator.local.rollout import rolling_out
from pdserve.operator.local.scaling import STATUS_FILE, LocalScaler


@dataclass(frozen=True)
class Monitoring:
    """What watches a local pool: a Prometheus started for it (or one at a URL), and
    the planner's rounds."""

    prometheus: bool = False  # start a Prometheus scraping the router and the workers
    scrape_interval_s: float = 5.0
    prometheus_url: str | None = None  # a Prometheus already scraping the pool


def serve(
    manifest: Path,
    model_dir: Path | None,
    host: str,
    port: int,
    port_file: Path | None,
    run_dir: Path | None,
    api_key_file: Path | None = None,
    monitoring: Monitoring = Monitoring(),
) -> int:
    """Run a pool until Ctrl-C (or SIGTERM); the exit code. Changes to the manifest
    while it runs are applied (see local/rollout.py)."""
    try:
        pool = load_manifest(manifest)
        check_port_free(host, port)  # the router's, before any worker starts
    except (LocalPoolError, api.InvalidPoolError, PortInUseError) as error:
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
        with watched(local, monitoring) as scaler, rolling_out(local, scaler, manifest, model_dir):
            if port_file is not None:
                announce_port(port_file, int(url.rsplit(":", 1)[1]))
            print(f"pool {local.name}: serving model {pool.spec.model.name} at {url}", flush=True)
            print(f"pool {local.name}: status in {folder / STATUS_FILE}", flush=True)
            print("Ctrl-C stops it", flush=True)
            return _wait(local, stop)
    except (RuntimeError, TimeoutError) as error:  # Prometheus did not start
        print(f"pdserve local: {error}", file=sys.stderr)
        return 1
    finally:
        local.stop()
        print(f"pool {local.name}: stopped", flush=True)


@contextlib.contextmanager
def watched(
    local: LocalPool, monitoring: Monitoring, binary: Path | None = None
) -> Iterator[LocalScaler]:
    """The planner's rounds over a started pool (status in its run folder), reading the
    Prometheus `monitoring` names or starts (`binary`: which one), until the block ends."""
    with contextlib.ExitStack() as running:
        url = monitoring.prometheus_url
        if monitoring.prometheus:
            server = PrometheusServer(
                local.run_dir / "prometheus", binary=binary,
                scrape_interval_s=monitoring.scrape_interval_s,
            )  # fmt: skip
            url = server.start(local.targets())
            running.callback(server.stop)
            local.on_targets = server.set_targets
            print(f"pool {local.name}: Prometheus at {url}", flush=True)
        scaler = LocalScaler(local.pool, local, url, local.run_dir / STATUS_FILE)
        scaler.start()
        running.callback(scaler.stop)
        yield scaler


def _wait(local: LocalPool, stop: threading.Event) -> int:
    """Serve until stopped. A worker that dies is reported (the router routes around
    it, as in a cluster, where it would be restarted); the router dying ends the run.
    Deaths are looked for once more when stopped, so none goes unreported."""
    reported: set[int] = set()
    while not stop.wait(0.5):
        if _report_exits(local, reported):
            return 1
    return 1 if _report_exits(local, reported) else 0


def _report_exits(local: LocalPool, reported: set[int]) -> bool:
    """Report the processes that exited since the last call; whether the router did."""
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
            return True
    return False
