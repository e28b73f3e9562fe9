"""The settings of the control plane's commands, `pdserve operator` and `pdserve local`,
each declared once (see `pdserve.base.options`). Below `cli` (which parses them), `main`
and the controller's handlers (which read them): it imports neither."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from pdserve.base.options import option, port_number, positive_float


def namespace_name(text: str) -> str:
    """A namespace's name (a DNS-1123 label), as a command-line value. The pattern is
    api.NAMESPACE_NAME's (not imported: `pdserve --help` loads no pydantic)."""
    if len(text) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", text):
        raise argparse.ArgumentTypeError(f"not a namespace name: {text!r}")
    return text


@dataclass(frozen=True)
class OperatorOptions:
    """The settings of `pdserve operator`."""

    namespace: tuple[str, ...] = option(
        repeat=True, short="-n", exclusive="scope", metavar="NS",
        help="watch this namespace (repeatable; default: all namespaces)",
    )  # fmt: skip
    all_namespaces: bool = option(
        False, short="-A", exclusive="scope", help="watch every namespace (the default)"
    )
    kubeconfig: Path | None = option(
        None, parse=Path,
        help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the pod's "
        "service account)",
    )  # fmt: skip
    default_image: str | None = option(
        None, metavar="IMAGE", help="worker image of pools whose spec names none"
    )
    metrics_host: str = option("0.0.0.0", help="address /metrics, /healthz and /readyz listen on")
    metrics_port: int = option(
        8080, parse=port_number, help="port of /metrics, /healthz and /readyz (0: any free port)"
    )
    port_file: Path | None = option(
        None, parse=Path, metavar="PATH", help="once listening, write the port here"
    )
    prometheus_url: str | None = option(
        None, metavar="URL",
        help="Prometheus scraping the pools: the planner reads it, KEDA's triggers ask it, "
        "and it tells whether disaggregation works (a pool's "
        "spec.autoscaling.policy.prometheusUrl overrides it)",
    )  # fmt: skip
    prometheus_namespace: str | None = option(
        None, parse=namespace_name, metavar="NS",
        help="namespace of the Prometheus scraping the pools: each pool's NetworkPolicy "
        "admits its pods to the workers' http port, for /metrics (a pool's "
        "spec.monitoring.prometheusNamespace overrides it; default: none is admitted)",
    )  # fmt: skip
    resync_interval: float = option(
        300.0, parse=positive_float, metavar="SECONDS",
        help="reconcile every pool from a fresh read this often, catching drift the "
        "watches missed (writes nothing when nothing drifted)",
    )  # fmt: skip
    verbose: bool = option(False, short="-v", help="debug logging")


@dataclass(frozen=True)
class LocalOptions:
    """The settings of `pdserve local`."""

    file: Path = option(
        parse=Path, short="-f", metavar="POOL.yaml",
        help="the ServingPool manifest (as for kubectl apply); edits to it are applied while "
        "the pool runs, a change to a role's workers rolled out by its strategy",
    )  # fmt: skip
    model_dir: Path | None = option(
        None, parse=Path, metavar="PATH",
        help="the model's checkpoint on this machine (default: spec.model.path)",
    )  # fmt: skip
    host: str = option("127.0.0.1", help="address the router and the workers listen on")
    port: int = option(8000, parse=port_number, help="the router's port (0: any free port)")
    port_file: Path | None = option(
        None, parse=Path, metavar="PATH", help="once serving, write the router's port here"
    )
    api_key_file: Path | None = option(
        None, parse=Path, metavar="PATH",
        help="require clients of the router to present a key from this file (one per line)",
    )  # fmt: skip
    run_dir: Path | None = option(
        None, parse=Path, metavar="DIR",
        help="folder for the logs, the routing file, the run's credential and the pool's "
        "status (status.json) (default: a new temporary folder)",
    )  # fmt: skip
    prometheus: bool = option(
        False,
        help="start a Prometheus (Debian's package, see scripts/ensure-prometheus.sh) "
        "scraping the router and the workers: the planner scales on it "
        "(spec.autoscaling) and the status says whether disaggregation works",
    )  # fmt: skip
    scrape_interval: float = option(
        5.0, parse=positive_float, metavar="SECONDS",
        help="how often the Prometheus of --prometheus scrapes the pool",
    )  # fmt: skip
    prometheus_url: str | None = option(
        None, metavar="URL",
        help="a Prometheus already scraping the pool, instead of --prometheus "
        "(spec.autoscaling.policy.prometheusUrl overrides it)",
    )  # fmt: skip
