"""Trials of the tree planner's search that build the same tree (:mod:`~mlfabric.scheduler.policies.trees`).

The planner's local search scores trees by ``(points, bypass, fan_in)``: the aggregation
points, how many payloads of each point go on unsummed, and the largest sum. Many of its
trials change nothing — a bypass at a point with two payloads, a fan-in above every
point's sum — and build a tree scored already. :func:`same_tree` gives such trials one
key, so the planner builds and estimates each tree once (issue 24; the plans are those of
building every trial, ``tests/scheduler/test_tree_search_shortcuts.py``). Internal to the
tree planner.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlfabric.scheduler.policies.trees import _Tree

__all__: list[str] = []

Key = tuple[frozenset[str], tuple[tuple[str, int], ...], int]  # points, bypass, fan-in


Carry = tuple[dict[str, int], list[tuple[str, str | None, bool]]]


def carry(tree: _Tree, points: frozenset[str]) -> Carry:
    """How ``trees._build`` carries payloads through ``points``, for :func:`same_tree`.

    The updates reaching each point first, and the points in the order they are summed,
    each with the next point up (None: the server) and whether a host below may sum there.
    """
    count: dict[str, int] = {}
    up: dict[str, str | None] = {}
    for on_path, uids in tree.groups.items():
        pts = [x for x in on_path if x in points]
        if not pts:
            continue
        for x in pts:
            count.setdefault(x, 0)
        for a, b in itertools.pairwise(pts):
            up[a] = b
        up.setdefault(pts[-1], None)
        count[pts[0]] += len(uids)
    depth, below = tree.depth, tree.below
    steps = [(x, up.get(x), bool(below.get(x))) for x in sorted(count, key=lambda x: (-depth[x], x))]
    return count, steps


def same_tree(
    tree: _Tree, points: frozenset[str], bypass: Mapping[str, int], fan_in: int, carried: Carry | None = None
) -> Key:
    """A key shared by every ``(points, bypass, fan_in)`` that ``trees._build`` makes the same tree of.

    Counts the payloads reaching each point as ``trees._build`` carries them (``carried``:
    :func:`carry` of ``points``, made here if not given). A point whose payloads are all
    passed on (fewer than two left to sum, or no host below) passes them on for every
    bypass from ``payloads - 1`` up (none: for every bypass); a fan-in that no point's sum
    exceeds splits nothing (as no limit). The planner's search tries many such bypasses
    and fan-ins (issue 24); the key is ``points``, the bypasses that change the tree
    (smallest of each run) and the fan-in that does (0 if none).
    """
    first, steps = carried if carried is not None else carry(tree, points)
    count = dict(first)
    skips: list[tuple[str, int]] = []
    widest = 0
    get = bypass.get
    for x, nxt, sums in steps:
        n = count[x]
        skip = get(x, 0)
        if skip > n:
            skip = n
        if n - skip < 2 or not sums:
            if n >= 2 and sums:
                skips.append((x, n - 1))  # passed on: as with the smallest bypass that does it
            if nxt is not None:
                count[nxt] += n
            continue
        if skip:
            skips.append((x, skip))
        if n - skip > widest:
            widest = n - skip
        if nxt is not None:
            count[nxt] += skip + 1
    return points, tuple(sorted(skips)), fan_in if widest > fan_in else 0
