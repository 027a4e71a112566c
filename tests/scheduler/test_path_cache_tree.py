"""The path cache's tree mode: the same paths as the searches, memory linear in the nodes (issue 24)."""

from __future__ import annotations

import itertools
import random
import tracemalloc
from pathlib import Path

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import PathCache, TopologyError, fat_tree, star, two_tier
from mlfabric.scheduler.core.schedule import Link, Update
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.aggregation import _choose_aggregator, _feeds_ingress

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def _searching(graph: nx.DiGraph) -> PathCache:
    """A cache that answers by breadth-first trees (the code before issue 24's tree mode)."""
    pc = PathCache(graph)
    pc._parent = {}
    return pc


def _random_tree(n: int, seed: int) -> nx.DiGraph:
    rng = random.Random(seed)
    g = nx.DiGraph()
    names = [f"n{i}" for i in range(n)]
    rng.shuffle(names)  # node order unlike the tree's shape
    g.add_node(names[0])
    for i in range(1, n):
        p = names[rng.randrange(i)]
        g.add_edge(names[i], p, capacity=1.0)
        g.add_edge(p, names[i], capacity=1.0)
    return g


@pytest.mark.parametrize(
    "graph",
    [
        two_tier(4, 5, 8e9, oversubscription=4.0),
        two_tier(1, 3, 8e9),
        star(5, 8e9),
        _random_tree(40, 0),
        _random_tree(40, 1),
    ],
)
def test_tree_paths_equal_the_searches_for_every_pair(graph: nx.DiGraph) -> None:
    tree, search = PathCache(graph), _searching(graph)
    assert tree.is_tree and not search.is_tree
    for src, dst in itertools.product(graph.nodes, graph.nodes):
        assert tree.path(src, dst) == search.path(src, dst)
        assert tree.next_hop(src, dst) == search.next_hop(src, dst)
        assert tree.links(src, dst) == search.links(src, dst)
    assert not tree._trees  # no breadth-first tree was built


def test_graphs_that_are_not_trees_are_searched() -> None:
    assert not PathCache(fat_tree(4, 8e9)).is_tree  # several shortest paths
    g = star(3, 8e9)
    g.remove_edge("sw", "h0")  # a one-way link
    assert not PathCache(g).is_tree
    g = star(3, 8e9)
    g.add_node("island")
    pc = PathCache(g)
    assert not pc.is_tree
    with pytest.raises(TopologyError, match="no path from 'island' to 'h0'"):
        pc.path("island", "h0")


def test_tree_mode_raises_as_the_searches() -> None:
    pc = PathCache(two_tier(2, 2, 8e9))
    with pytest.raises(TopologyError, match="'nope' is not a host"):
        pc.path("nope", "h0")
    with pytest.raises(TopologyError, match="'nope' is not a host"):
        pc.path("h0", "nope")
    with pytest.raises(TopologyError, match="'nope' is not a host"):
        pc.next_hop("nope", "h0")


def test_memory_of_paths_to_every_host_is_linear_in_the_nodes() -> None:
    g = two_tier(64, 16, 8e9, oversubscription=4.0)  # 1,024 hosts
    hosts = [v for v in g if g.nodes[v]["kind"] == "host"]
    tracemalloc.start()
    try:
        pc = PathCache(g)
        for dst in hosts:  # every host a destination (stf+agg: every candidate aggregator)
            pc.path(hosts[0], dst)
            pc.next_hop(hosts[-1], dst)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not pc._trees
    assert peak < 2_000_000  # one breadth-first tree per destination: ~100 MB


def test_links_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PathCache, "MAX_LINKS", 8)
    g = two_tier(4, 4, 8e9)
    pc, search = PathCache(g), _searching(g)
    for src, dst in itertools.product(g.nodes, g.nodes):
        assert pc.links(src, dst) == search.links(src, dst)
        assert len(pc._links) <= 8


@pytest.mark.parametrize("policy", ["stf+agg", "stf", "stf+tree"])
def test_simulated_outcomes_are_those_of_the_searches(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tree mode changes no decision: the digest of every update's record is the search mode's."""
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    from sim_outcome_digest import digest

    seeds = (0, 1) if policy == "stf+agg" else (0,)
    fast = [digest(128, policy, s)["digest"] for s in seeds]
    monkeypatch.setattr(PathCache, "_root_tree", lambda self: None)  # search mode
    assert [digest(128, policy, s)["digest"] for s in seeds] == fast


def _choose_by_every_key(
    graph: nx.DiGraph,
    tls: Timelines,
    pc: PathCache,
    update: Update,
    aggregators: list[str],
    avoid: set[Link],
    ready: float,
) -> str | None:
    """:func:`_choose_aggregator` before issue 24's pruning: every candidate's full key."""
    keys = []
    for a in aggregators:
        to_a = pc.links(update.src, a)
        if a == update.dst or avoid.intersection(to_a):
            continue
        try:
            _, arrive = tls.ten(to_a, update.bytes, ready)
            onward_links = pc.links(a, update.dst)
            _, onward = tls.ten(onward_links, update.bytes, arrive)
        except ValueError:
            continue
        keys.append((not _feeds_ingress(graph, onward_links), arrive, onward, a))
    return min(keys)[3] if keys else None


@pytest.mark.parametrize("seed", range(6))
def test_pruned_aggregator_choice_is_the_full_keys_minimum(seed: int) -> None:
    rng = random.Random(seed)
    nic = {f"h{i}": rng.choice([8e9, 2e9]) for i in range(32)}
    g = two_tier(4, 8, nic, oversubscription=4.0)
    pc, tls = PathCache(g), Timelines(g)
    hosts = sorted(nic, key=lambda h: int(h[1:]))
    for i in range(40):  # links busy for a while
        src, dst = rng.sample(hosts, 2)
        tls.reserve_until(pc.links(src, dst), 0.0, rng.uniform(0.0, 3.0), who=f"r{i}")
    chosen: set[str | None] = set()
    for i in range(20):
        src = rng.choice(hosts[1:])
        u = Update(f"u{i}", src, "h0", rng.uniform(1e6, 1e8))
        avoid: set[Link] = {(f"tor{rng.randrange(4)}", "core")} if i % 2 else set()
        ready = rng.uniform(0.0, 2.0)
        got = _choose_aggregator(g, tls, pc, u, hosts[1:], avoid, ready)
        assert got == _choose_by_every_key(g, tls, pc, u, hosts[1:], avoid, ready)
        chosen.add(got)
    assert len(chosen) > 1  # not one answer throughout
