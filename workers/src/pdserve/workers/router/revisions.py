"""Traffic by revision during a rollout: which of a role's workers a request may use.

The routing table's `revisions` give each revision of a role its share of the role's
requests; each worker says its revision at `/load` (its `--revision`). A request gets a
point in [0, 100) from what identifies its conversation (the OpenAI `user` field, else
the prompt's first KV block), and the revision whose share holds that point serves it.
The point does not change from one turn of a conversation to the next, so its history
stays on one revision (where KV-aware routing finds it); and since the shares are laid
out in the table's order (the stable revision first), a canary's growing share takes
conversations over from the stable revision, never the other way round.

A revision with no live worker falls back to the others (a request is never failed for
a split); a worker whose revision the list does not name gets requests only when no
named revision has a live worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pdserve.protocol.routing import RevisionWeight, Role, RoutingTable
from pdserve.workers.router.workers import Worker, WorkerSet

# The point's resolution: a share of 1% holds 100 positions.
_POSITIONS = 10_000


@dataclass(frozen=True)
class RevisionSplit:
    """A request's place in the table's split of each role's traffic."""

    point: float  # in [0, 100): where the request falls among the revisions' shares
    prefill: tuple[RevisionWeight, ...]
    decode: tuple[RevisionWeight, ...]

    @classmethod
    def of(
        cls, table: RoutingTable, token_ids: Sequence[int], user: str | None
    ) -> RevisionSplit | None:
        """The split of a request with `token_ids` from `user`; None when the table
        splits no role's traffic."""
        revisions = table.revisions
        if not revisions.prefill and not revisions.decode:
            return None
        block = token_ids[: table.routing_policy.block_size]
        return cls(conversation_point(block, user), revisions.prefill, revisions.decode)

    def weights(self, role: Role) -> tuple[RevisionWeight, ...]:
        """The revisions of `role` and their shares."""
        return self.prefill if role == "prefill" else self.decode

    def wanted(self, role: Role) -> str | None:
        """The revision of `role` whose share holds the request (None: no split)."""
        weights = self.weights(role)
        start = 0.0
        for revision in weights:
            start += revision.weight
            if self.point < start:
                return revision.name
        return weights[-1].name if weights else None

    def outside(self, workers: WorkerSet, tried: Collection[str]) -> set[str]:
        """The workers of `workers` the request must not use: all but those of the
        first revision, in order of preference, with a live worker not yet tried
        (empty when the role is not split, or no named revision has one)."""
        usable = [w for w in workers.available() if w.url not in tried]
        for name in self._preference(workers.role):
            members = {w.url for w in usable if w.revision == name}
            if members:
                return {w.url for w in workers if w.url not in members}
        return set()

    def _preference(self, role: Role) -> list[str]:
        """The wanted revision first, then the others by share, largest first."""
        wanted = self.wanted(role)
        others = sorted(
            (r for r in self.weights(role) if r.name != wanted), key=lambda r: -r.weight
        )
        return ([wanted] if wanted is not None else []) + [r.name for r in others]


def conversation_point(first_block: Sequence[int], user: str | None) -> float:
    """A point in [0, 100) that is the same for every request of a conversation: from
    the client's `user` when it gives one, else from the prompt's first tokens (a
    conversation's turns share them: the system prompt and the first message)."""
    if user:
        data = b"user:" + user.encode()
    else:
        data = b"tokens:" + b",".join(str(t).encode() for t in first_block)
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return (int.from_bytes(digest, "big") % _POSITIONS) * 100 / _POSITIONS


def revision_of(worker: Worker | None) -> str:
    """A worker's revision as a metric label (empty: none, or not known yet)."""
    return "" if worker is None or worker.revision is None else worker.revision
