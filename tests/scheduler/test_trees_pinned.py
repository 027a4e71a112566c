"""The tree planner's plans pinned on fixed instances (its speed-ups must not change a plan).

Each digest is the SHA-256 of the ``repr`` of a plan (every transfer with its reservations,
every aggregate) or of a decision (every send, aggregate and drop, with expected times),
recorded from the planner before its decision-time work (issue 13, commit cf7666b). A
change to a digest is a change of plan: if it is intended, say so in the commit and
record the new digests.
"""

from __future__ import annotations

import hashlib
import itertools
import random

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import PathCache, hosts, two_tier
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.policies.tree_routes import SHAPES_KEPT, RouteCache
from mlfabric.scheduler.policies.trees import plan_tree

MB = 1_000_000


def digest(obj: object) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def nics(n: int, seed: int) -> dict[str, float]:
    """70 % 10 Gbit/s, 20 % 25 Gbit/s, 10 % 2.5 Gbit/s (as experiments/bench_trees.py); h0 never slow."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        x = rng.random()
        out[f"h{i}"] = 25e9 if x < 0.2 else (2.5e9 if x > 0.9 and i > 0 else 10e9)
    return out


def pending(g_hosts: list[str], seed: int, ready: bool) -> list[PendingUpdate]:
    rng = random.Random(seed)
    return [
        PendingUpdate(
            f"u{h}",
            "j",
            "s",
            h,
            h,
            "h0",
            rng.choice([5, 20, 40]) * MB,
            1.0,
            0,
            rng.random() * 0.01 if ready else 0.0,
        )
        for h in g_hosts
    ]


def motivating_plan() -> object:
    g = two_tier(2, 6, 10e9, oversubscription=60)
    s = plan_tree(g, [Update(f"u{i}", f"h{i}", "h0", 20 * MB) for i in range(1, 12)])
    return (s.transfers, s.aggregates)


def slow_server_plan() -> object:
    nic = {f"h{i}": 10e9 for i in range(18)}
    nic["h0"] = 1e9
    g = two_tier(3, 6, nic, oversubscription=4)
    s = plan_tree(g, [Update(f"u{i}", f"h{i}", "h0", 20 * MB) for i in range(1, 18)])
    return (s.transfers, s.aggregates)


def two_servers_plan() -> object:
    """Local search, two servers, restricted aggregators, updates ready at different times."""
    g = two_tier(4, 6, nics(24, 3), oversubscription=8)
    rng = random.Random(7)
    us = [
        Update(
            f"u{i}", f"h{i}", "h0" if i % 3 else "h1", rng.choice([5, 20]) * MB, ready_at=rng.random() * 0.02
        )
        for i in range(2, 24)
    ]
    s = plan_tree(g, us, aggregators=[f"h{i}" for i in range(2, 24, 2)])
    return (s.transfers, s.aggregates)


def large_round_decisions() -> object:
    """A round above LOCAL_SEARCH_UP_TO (the candidate sets and fan-ins only), decided twice."""
    g = two_tier(10, 32, nics(320, 1), oversubscription=4)
    ps = pending([f"h{i}" for i in range(1, 320)], 1, ready=False)
    policy = TreePolicy()
    return (policy.decide(Snapshot(0.0, g), ps), policy.decide(Snapshot(0.0, g), ps))


def in_flight_decision() -> object:
    """Mixed sizes and ready times, transfers in flight on some rack uplinks."""
    g = two_tier(8, 16, nics(128, 2), oversubscription=4)
    pc = PathCache(g)
    busy = tuple(
        InFlight(f"f{i}", "j", "s", pc.path(f"h{i}", "h0"), 10 * MB, 0.0, 0.004 + 0.001 * (i % 7))
        for i in range(64, 80)
    )
    ps = pending([f"h{i}" for i in range(1, 64)], 2, ready=True)
    return TreePolicy().decide(Snapshot(0.001, g, in_flight=busy), ps)


# large_round and in_flight re-recorded when decisions' aggregates gained ``hold_until`` (issue 23):
# their repr changed, their plans did not (the old digests are those of the reprs without it); again
# when they gained ``chunk_bytes`` (pipelined aggregates): with ", chunk_bytes=0" taken out of the
# repr the digests are the ones before (34141b2d423c8688, 438f554b8d14ca26)
PINNED = {
    "motivating": (motivating_plan, "98d1c52ae24c440a"),
    "slow_server": (slow_server_plan, "18e0408d68d2177e"),
    "two_servers": (two_servers_plan, "8bc8284f983c5a48"),
    "large_round": (large_round_decisions, "93ef02de48a6eaed"),
    "in_flight": (in_flight_decision, "388b258578ac54b1"),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_plan_is_the_pinned_one(name: str) -> None:
    make, want = PINNED[name]
    assert digest(make()) == want


def test_a_route_cache_kept_across_capacities_plans_as_a_fresh_one() -> None:
    # same topology, other capacities: the routes are kept, the plan follows the capacities
    ps = pending([f"h{i}" for i in range(1, 48)], 4, ready=False)
    a, b = two_tier(6, 8, nics(48, 4), oversubscription=4), two_tier(6, 8, nics(48, 5), oversubscription=2)
    kept = RouteCache(PathCache(a))
    updates = [Update(p.update_id, p.src_host, "h0", p.bytes) for p in ps]
    for g in (a, b, a):
        fresh = plan_tree(g, updates)
        reused = plan_tree(g, updates, paths=kept.pc, routes=kept)
        assert digest((reused.transfers, reused.aggregates)) == digest((fresh.transfers, fresh.aggregates))


def test_routes_of_another_path_cache_are_refused() -> None:
    g = two_tier(2, 3, 10e9)
    with pytest.raises(ValueError, match="another path cache"):
        plan_tree(g, [Update("u1", "h1", "h0", MB)], paths=PathCache(g), routes=RouteCache(PathCache(g)))


def test_a_route_cache_kept_across_rounds_plans_as_a_fresh_one() -> None:
    # the tree shapes a RouteCache keeps (per server, sources, aggregators and host order)
    # never change a plan: other sources, other aggregators, hosts listed in another order
    g = two_tier(6, 8, nics(48, 4), oversubscription=4)
    back = nx.DiGraph()  # the same topology, its nodes in the reverse order
    back.add_nodes_from(reversed(list(g.nodes(data=True))))
    back.add_edges_from(g.edges(data=True))
    kept = RouteCache(PathCache(g))
    ps = pending([f"h{i}" for i in range(1, 48)], 6, ready=True)
    us = [Update(p.update_id, p.src_host, "h0", p.bytes, ready_at=p.ready_at) for p in ps]
    rounds = [(g, us, None), (g, us[:20], None), (g, us, ["h3", "h9", "h17", "h30"]), (back, us, None)]
    for graph, updates, aggs in rounds + rounds[::-1]:
        fresh = plan_tree(graph, updates, aggregators=aggs)
        reused = plan_tree(graph, updates, aggregators=aggs, paths=kept.pc, routes=kept)
        assert digest((reused.transfers, reused.aggregates)) == digest((fresh.transfers, fresh.aggregates))
    assert len(kept._shapes) == SHAPES_KEPT


def test_tree_routes_are_the_checked_ones() -> None:
    g = two_tier(3, 4, nics(12, 2), oversubscription=2)
    rc = RouteCache(PathCache(g))
    tree = {h: rc.path(h, "h0") for h in hosts(g)}
    routes = rc.routes(g, "h0", tree)
    for a in tree:
        for b in tree:
            assert routes.tree_path(a, b) == routes.path(a, b)
            assert routes.tree_ids(a, b) == routes.ids(a, b)
            assert [rc.links[i] for i in routes.tree_ids(a, b)] == list(itertools.pairwise(routes.path(a, b)))
