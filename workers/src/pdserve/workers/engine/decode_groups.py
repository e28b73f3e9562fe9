"""How decodes are grouped for attention, and the keys they read: one rule shared by
the runner's attention (which attends each group in one call, padded to its longest)
and the step-cost model (which counts the keys those calls read)."""

from __future__ import annotations

from collections.abc import Sequence

# A decode joins the group of longer ones unless padding it to the group's longest
# context would more than double its share of the work: each call then does at most
# twice the attention its streams need, and lengths from 100 to 100,000 tokens make at
# most ten calls. Equal (or near-equal) lengths stay one call, as one padded call is.
GROUP_MAX_PADDING = 0.5  # of the group's longest context


def group_rows(lengths: Sequence[int]) -> list[list[int]] | None:
    """The decodes' rows in groups of similar context length (`lengths`, one per row),
    longest first, each group's rows in order; None when they make one group (the
    common case: no sort)."""
    if not lengths or min(lengths) >= (1 - GROUP_MAX_PADDING) * max(lengths):
        return None
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    members: list[list[int]] = []
    for row in order:
        if not members or lengths[row] < (1 - GROUP_MAX_PADDING) * lengths[members[-1][0]]:
            members.append([])
        members[-1].append(row)
    return [sorted(rows) for rows in members]


def attended_keys(lengths: Sequence[int]) -> int:
    """The keys the decodes of these context lengths read: each group's decodes as many
    as its longest."""
    groups = group_rows(lengths)
    if groups is None:
        return len(lengths) * max(lengths, default=0)
    return sum(len(rows) * max(lengths[row] for row in rows) for rows in groups)
