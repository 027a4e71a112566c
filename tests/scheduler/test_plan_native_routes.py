"""The tree routes' and the decision adapter's C loops against their Python (issue 24).

``plan_routes.c`` stands in for ``tree_routes.py``'s per-host loops (every host's path, the
tree's shape, bottlenecks, a route's destination), ``trees._tree``'s tables and
``schedule_to_decision``'s sends. Each case runs with the C module and with every module's
``_plan_native`` set to None (the Python, as where the extension is not built), on seeded
graphs, and compares the ``repr`` of what comes out.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import networkx as nx
import pytest

from mlfabric.scheduler.core import records
from mlfabric.scheduler.core.graph import PathCache, fat_tree, hosts, two_tier
from mlfabric.scheduler.core.schedule import Aggregate, Schedule, Transfer, Update
from mlfabric.scheduler.policies import trees
from mlfabric.scheduler.policies.convert import schedule_to_decision
from mlfabric.scheduler.policies.tree_routes import RouteCache
from tests.scheduler.test_plan_native import both

MB = 1_000_000


def seeded_graph(seed: int) -> nx.DiGraph:
    """A two-tier graph of mixed NICs, sometimes a fat tree, sometimes with a one-way or a cut host."""
    rng = random.Random(seed)
    if rng.random() < 0.2:
        return fat_tree(4, 10e9)
    racks, per = rng.choice([(2, 3), (3, 5), (5, 8), (8, 16)])
    n = racks * per
    g = two_tier(
        racks,
        per,
        {f"h{i}": rng.choice([2.5e9, 10e9, 25e9]) for i in range(n)},
        oversubscription=rng.choice([1, 2, 4]),
    )
    if rng.random() < 0.5:  # a host whose link in is gone: routes down to it go round, or nowhere
        h = f"h{rng.randrange(1, n)}"
        g.remove_edge(next(iter(g.pred[h])), h)
    if rng.random() < 0.5:  # a host with no link out: no path to the server
        h = f"h{rng.randrange(1, n)}"
        for v in list(g.succ[h]):
            g.remove_edge(h, v)
    return g


def attempt(f: Callable[[], object]) -> object:
    """What ``f`` returns, or the error it raises (no path: either way the same)."""
    try:
        return f()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"


def routes_of(seed: int) -> object:
    """Every route cache product on a seeded graph: hosts' paths, shape, bottlenecks, routes."""
    rng = random.Random(seed)
    g = seeded_graph(seed)
    every = hosts(g)
    server = every[0]
    rc = RouteCache(PathCache(g))
    with_path = [h for h in every[1:] if h in rc.pc.next_hops(server)]
    sources = frozenset(rng.sample(with_path, max(1, len(with_path) // 2)))
    eligible = frozenset(rng.sample(every, max(1, 3 * len(every) // 4))) - {server}
    shape = rc.shape(server, eligible, sources, every)
    tree = rc.server(server)
    bott = rc.bottlenecks(g, server, sources)
    pairs = [(a, b) for a in sorted(shape.paths) for b in sorted(shape.paths) if rng.random() < 0.2]
    routes = rc.routes(g, server, shape.paths)
    ids = [(a, b, attempt(partial(routes.ids, a, b)), attempt(partial(routes.path, a, b))) for a, b in pairs]
    ids += [(a, server, routes.tree_ids(a, server), routes.tree_path(a, server)) for a in sorted(sources)]
    hosts_ = [(v, h.path, h.up) for v, h in tree.hosts.items()]
    dsts = [(v, d.pos, d.down, d.back) for v, d in tree.dsts.items()]
    return shape.paths, shape.below, shape.rank, bott, ids, hosts_, dsts, list(rc.links), tree.ids, tree.walks


@pytest.mark.parametrize("seed", range(25))
def test_route_caches_are_the_python_ones(seed: int) -> None:
    native, python = both(lambda: routes_of(seed))
    assert native == python


def tree_of(seed: int) -> object:
    """trees._tree's fields (the tables in C) and the candidate trees built on them."""
    rng = random.Random(seed)
    g = seeded_graph(seed)
    every = hosts(g)
    rc = RouteCache(PathCache(g))
    reach = rc.pc.next_hops(every[0])
    srcs = [h for h in every[1:] if h in reach]
    order = [
        Update(f"u{h}", h, every[0], rng.choice([5, 20]) * MB, ready_at=rng.random() * 0.01)
        for h in rng.sample(srcs, max(1, len(srcs) - 1))
    ]
    eligible = frozenset(h for h in every[1:] if rng.random() < 0.8)
    tree = trees._tree(g, rc, order, eligible, every[0], every)
    candidates, _ = trees._points_of(tree.groups, g)
    built = [trees._build(tree, p, {}, fan) for p in candidates for fan in (0, 2)]
    return dataclasses.astuple(tree), built


@pytest.mark.parametrize("seed", range(25))
def test_tree_tables_are_the_python_ones(seed: int) -> None:
    native, python = both(lambda: tree_of(seed))
    assert native == python


def test_decisions_with_a_replica_run_the_python_loop() -> None:
    """A plan with a replica's transfer: the Python loop (the C returns None); else the C, the same."""

    def decide(replica: bool) -> object:
        ins = [Transfer.at_rate(u, (u, "x"), start=0, bytes=1, rate=1) for u in ("w2", "w3")]
        out = Transfer.at_rate("agg:ps:0", ("x", "ps"), start=1, bytes=1, rate=1)
        direct = Transfer.at_rate("v", ("w4", "ps"), start=0, bytes=1, rate=2)
        copy = Transfer.at_rate("v", ("ps", "rep"), start=1, bytes=1, rate=1, replica=True)
        transfers = [*ins, out, direct, *([copy] if replica else [])]
        plan = Schedule.aggregated(transfers, [Aggregate("agg:ps:0", "x", ("w2", "w3"), 1, "ps")])
        return schedule_to_decision(plan, aggregate_ids={"agg:ps:0": "agg:ps:7", "v": "v"})

    plain, python = both(lambda: decide(False))
    assert plain == python
    native, python = both(lambda: decide(True))
    assert native == python and "ReplicaSend(" in native


def test_instances_of_a_dataclass_with_post_init_are_its_calls() -> None:
    rows: list[tuple[Any, ...]] = [
        ("u1", "h1", "h0", 10.0, 0.5, 1.0, 3, ""),  # no server: __post_init__ names dst
        ("u2", "h2", "h0", 20.0, 0.0, 0.0, 0, "j/s"),
    ]
    made = records.instances(Update, rows)
    assert made == [Update(*row) for row in rows]
    assert [u.server for u in made] == ["h0", "j/s"]
    assert repr(made) == repr([Update(*row) for row in rows])
    assert records.init_fields(Update) is None  # the C loops that fill fields only never take it


@pytest.mark.parametrize("now", [0, 0.0, 0.004])
def test_int_ready_times_plan_as_in_python(now: float) -> None:
    """max(ready_at, now) keeps Python's object (an int ready time stays an int) in C too."""

    def plan() -> object:
        g = two_tier(3, 4, {f"h{i}": 10e9 if i % 3 else 25e9 for i in range(12)}, oversubscription=4)
        us = [
            Update(f"u{i}", f"h{i}", "h0", 5 * MB, ready_at=(0 if i % 2 else 0.002 * i)) for i in range(1, 12)
        ]
        s = trees.plan_tree(g, us, now=now)
        return s.transfers, s.aggregates

    native, python = both(plan)
    assert native == python
