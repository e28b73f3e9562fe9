"""A router in front of workers started apart (so a test can restart either, or
start one with other settings), and what KV-aware routing reports."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve.base.process import ServerProcess, start_server
from support.prom import total
from support.waiting import wait_until


def routing_file(
    folder: Path,
    model_dir: Path,
    decode: Sequence[str],
    prefill: Sequence[str] = (),
    policy: str = "kv-aware",
    boundary: int | None = None,
    block_size: int = 16,
) -> Path:
    """A static routing table over `decode` and `prefill` workers: prompts of up to
    `boundary` tokens colocated, longer ones disaggregated (all colocated without)."""
    buckets: list[dict[str, Any]] = [{"mode": "colocated"}]
    if boundary is not None:
        buckets = [{"maxInputTokens": boundary, "mode": "colocated"}, {"mode": "disaggregated"}]
    table = {
        "pool": "kv",
        "model": {"name": "small", "path": str(model_dir)},
        "buckets": buckets,
        "routingPolicy": {"type": policy, "blockSize": block_size},
        "discovery": {"kind": "static", "decode": list(decode), "prefill": list(prefill)},
    }
    path = folder / "routing.json"
    path.write_text(json.dumps(table))
    return path


@contextmanager
def kv_router(table: Path, credential: Path, log: Path) -> Iterator[ServerProcess]:
    """A ready router on `table`, holding the pool's credential."""
    router = start_server(
        "router", log, ["--config", str(table), "--internal-token-file", str(credential)]
    )
    try:
        router.wait_ready()
        yield router
    finally:
        router.stop()


def feeds(router_url: str) -> dict[str, dict[str, Any]]:
    """Each worker's KV feed state in the router's /workers, by URL."""
    with urllib.request.urlopen(f"{router_url}/workers", timeout=5) as answer:
        found = json.load(answer)
    return {w["url"]: w["kv"] for role in found.values() for w in role}


def wait_synced(router_url: str, urls: Sequence[str], timeout: float = 60) -> None:
    """Until the router's index holds every one of `urls`' feeds."""

    def synced() -> bool:
        states = feeds(router_url)
        return all((states.get(url) or {}).get("state") == "synced" for url in urls)

    wait_until(synced, timeout, f"the KV feeds of {list(urls)} to be synced")


def metric(url: str, name: str, **labels: str) -> float:
    """A metric of a router or worker."""
    return total(f"{url}/metrics", name, **labels)
