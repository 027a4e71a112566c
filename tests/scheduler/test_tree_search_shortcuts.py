"""The tree planner's shortcuts decide as the long way does (issue 24).

* ``trees._same_tree``: trials with the same key build the same tree (a bypass that passes
  every payload on, a fan-in no sum exceeds), so the planner scores one of them only;
* ``tree_cost.trial_timelines``: reserving a tree on the copy of its own links' timelines
  gives what reserving it on a copy of every timeline gives;
* ``plan_tree`` with both shortcuts turned off (every trial built, every timeline copied)
  plans the same transfers and aggregates on seeded instances.
"""

from __future__ import annotations

import random

import pytest

from mlfabric.scheduler.core.graph import PathCache, hosts, two_tier
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies import tree_moves, trees
from mlfabric.scheduler.policies.tree_cost import reserve, trial_timelines
from mlfabric.scheduler.policies.tree_moves import Node
from mlfabric.scheduler.policies.tree_routes import RouteCache

MB = 1e6
Tree = tuple[dict[str, Node], dict[str, str]]


def nics(n: int, rng: random.Random) -> dict[str, float]:
    return {f"h{i}": rng.choice([2.5e9, 10e9, 10e9, 25e9]) if i else 10e9 for i in range(n)}


def instance(seed: int, most: int = 40) -> tuple[object, list[Update], Timelines | None, float]:
    """A seeded two-tier round to ``h0``: NICs, sizes, ready times, some transfers in flight."""
    rng = random.Random(seed)
    racks, per = rng.choice([(2, 4), (3, 6), (4, 8), (6, 8), (8, 16)])
    n = racks * per
    g = two_tier(racks, per, nics(n, rng), oversubscription=rng.choice([1, 2, 4, 8]))
    chosen = rng.sample(range(1, n), min(n - 1, rng.randint(2, most)))
    spread = rng.choice([0.0, 0.005])
    us = [
        Update(f"u{i}", f"h{i}", "h0", rng.choice([5, 10, 20]) * MB, ready_at=rng.random() * spread)
        for i in chosen
    ]
    timelines, now = None, 0.0
    if rng.random() < 0.6:
        now = 0.001
        pc = PathCache(g)
        timelines = Timelines(g, start=now)
        for k in rng.sample(range(1, n), max(1, n // 4)):
            timelines.reserve_until(pc.links(f"h{k}", "h0"), now, now + rng.random() * 0.01)
    return g, us, timelines, now


def shape(built: Tree) -> object:
    nodes, parent = built
    return [(a, n.point, n.aggregator, n.members, n.parent) for a, n in nodes.items()], parent


@pytest.mark.parametrize("seed", range(12))
def test_trials_with_the_same_key_build_the_same_tree(seed: int) -> None:
    g, us, _, _ = instance(seed)
    order = sorted(us, key=lambda u: (u.ready_at, u.update_id))
    every = hosts(g)
    eligible = frozenset(h for h in every if h != "h0")
    tree = trees._tree(g, RouteCache(PathCache(g)), order, eligible, "h0", every)
    candidates, switches = trees._points_of(tree.groups, g)
    rng = random.Random(seed)
    shared = 0
    for _ in range(60):
        some = frozenset(rng.sample(sorted(switches), rng.randint(1, len(switches))))
        points = rng.choice([*candidates, some])
        bypass = {x: rng.choice([0, 1, 2, 3, 5, 16]) for x in points if rng.random() < 0.5}
        fan = rng.choice([0, 2, 4, 8])
        got_points, skips, got_fan = trees._same_tree(tree, points, bypass, fan)
        assert got_points == points
        same = trees._build(tree, points, dict(skips), got_fan)
        assert shape(same) == shape(trees._build(tree, points, bypass, fan))
        shared += (skips, got_fan) != (tuple(sorted((x, k) for x, k in bypass.items() if k)), fan)
    assert shared  # the seeds do try bypasses and fan-ins that change nothing


@pytest.mark.parametrize("seed", range(12))
def test_a_trial_on_its_own_links_reserves_as_on_a_copy_of_all(seed: int) -> None:
    g, us, timelines, now = instance(seed, most=16)
    tls = timelines if timelines is not None else Timelines(g, start=now)
    order = sorted(us, key=lambda u: (u.ready_at, u.update_id))
    every = hosts(g)
    eligible = frozenset(h for h in every if h != "h0")
    rc = RouteCache(PathCache(g))
    tree = trees._tree(g, rc, order, eligible, "h0", every)
    routes = rc.routes(g, "h0", tree.paths, tls)
    candidates, _ = trees._points_of(tree.groups, g)
    rng = random.Random(seed)
    idle = sorted(h for h in tree.paths if h in eligible)
    for points in candidates:
        start = trees._build(tree, points, {}, rng.choice([0, 2]))
        trials: list[Tree] = []

        def score(nodes: dict[str, Node], parent: dict[str, str], trials: list[Tree] = trials) -> float:
            trials.append(tree_moves._fresh((nodes, parent)))
            return rng.random()  # any order of moves: the trees tried are what matters

        ids, src = [u.update_id for u in order], {u.update_id: u.src for u in order}
        tree_moves.improve_members(start, ids, src, idle, eligible, score, "h0", 40)
        for nodes, parent in [start, *trials]:
            whole = reserve(tls.copy(), routes, order, nodes, parent, "h0", now)
            own = trial_timelines(tls, routes, order, nodes, parent, "h0")
            part = reserve(own, routes, order, nodes, parent, "h0", now)
            assert repr(part) == repr(whole)


@pytest.mark.parametrize("seed", range(10))
def test_the_planner_decides_as_without_the_shortcuts(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g, us, timelines, now = instance(100 + seed, most=24 if seed % 2 else 12)
    fast = trees.plan_tree(g, us, now=now, timelines=timelines.copy() if timelines is not None else None)
    monkeypatch.setattr(trees, "_same_tree", lambda tree, points, bypass, fan, *_: (points, object(), fan))
    monkeypatch.setattr(
        trees, "_trial_timelines", lambda tls, routes, order, nodes, parent, server_host: tls.copy()
    )
    slow = trees.plan_tree(g, us, now=now, timelines=timelines)
    assert repr((fast.transfers, fast.aggregates)) == repr((slow.transfers, slow.aggregates))
