"""The router splitting a role's traffic between two revisions of real workers: each
request goes to the revision its conversation's place in the split names (every turn
of a conversation to the same one), the metrics say which revision served it, and a
revision whose workers are gone falls back to the other without a failed request."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from pdserve.operator.local.pool import LocalPool
from pdserve.protocol.routing import RevisionWeight, read_table
from pdserve.workers.router.revisions import RevisionSplit
from support.prom import total
from support.rollouts import rollout_pool
from support.router import known_workers
from support.waiting import wait_until
from support.worker import metric

OTHER = "decode-other"


def served_by(local: LocalPool) -> dict[str, float]:
    """Requests the router counted, by the decode revision that served them."""
    revisions = (local.stable["decode"], OTHER)
    url = f"{local.url}/metrics"
    return {r: total(url, "pdserve_router_requests_total", decode_revision=r) for r in revisions}


def revisions_known(local: LocalPool) -> set[str]:
    """The decode revisions the router has learnt from its workers."""
    return {w["revision"] for w in known_workers(local.url)["decode"] if w["revision"]}


def complete(url: str, prompt: list[int], tokens: int) -> int:
    """A greedy completion through the router; its HTTP status."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return int(answer.status)


def conversation(i: int, turn: int) -> list[int]:
    """Turn `turn` of conversation `i`: its history grows, its first block stays."""
    return [10 + i] * 20 + list(range(100, 100 + 8 * turn))


def test_requests_follow_their_conversations_revision_and_fall_back(
    small_model_dir: Path, tmp_path: Path
) -> None:
    pool = rollout_pool("split", small_model_dir, {"type": "replace"})
    other = rollout_pool("split", small_model_dir, {"type": "replace"}, maxNumSeqs=8)
    with LocalPool(pool, tmp_path) as local:
        stable = local.stable["decode"]
        local.specs[OTHER] = other.spec
        local.add("decode", OTHER)
        split = (RevisionWeight(name=stable, weight=50), RevisionWeight(name=OTHER, weight=50))
        reloads = _reloads(local)
        local.set_weights("decode", split)
        wait_until(lambda: revisions_known(local) == {stable, OTHER}, 60, "both revisions known")
        _, table = read_table(local.routing_file)
        wait_until(lambda: _reloads(local) > reloads, 60, "the split in force")
        chosen = set()
        for i in range(8):
            for turn in range(3):
                prompt = conversation(i, turn)
                place = RevisionSplit.of(table, prompt, None)
                assert place is not None
                wanted = place.wanted("decode")
                before = served_by(local)
                assert complete(local.url, prompt, 2) == 200
                after = served_by(local)
                assert after[wanted or ""] == before[wanted or ""] + 1, (i, turn, wanted)
                chosen.add(wanted)
        assert chosen == {stable, OTHER}  # eight conversations, both revisions
        # The workers' own metrics carry their revision too.
        (other_worker,) = local.of_revision("decode", OTHER)
        assert metric(other_worker, "pdserve_requests_total", revision=OTHER) > 0
        local.remove("decode", OTHER)
        for i in range(8):
            assert complete(local.url, conversation(i, 0), 2) == 200


def _reloads(local: LocalPool) -> float:
    """The routing tables the router has re-read and applied."""
    url = f"{local.url}/metrics"
    return total(url, "pdserve_router_config_reloads_total", result="applied")
