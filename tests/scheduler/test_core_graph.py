"""Bandwidth graph presets and the path cache."""

from __future__ import annotations

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import (
    PathCache,
    TopologyError,
    fat_tree,
    hosts,
    shortest_path,
    star,
    two_tier,
)


def test_two_tier_shape_and_oversubscribed_uplinks() -> None:
    g = two_tier(4, 8, 10e9, oversubscription=4.0)
    assert len(hosts(g)) == 32
    assert g["h9"]["tor1"]["capacity"] == pytest.approx(10e9 / 8)
    assert g["tor1"]["core"]["capacity"] == pytest.approx(8 * 10e9 / 8 / 4)
    assert PathCache(g).path("h0", "h31") == ("h0", "tor0", "core", "tor3", "h31")
    assert PathCache(g).path("h0", "h7") == ("h0", "tor0", "h7")


def test_two_tier_heterogeneous_nics_and_single_rack() -> None:
    nic = {f"h{i}": (1e9 if i % 2 else 25e9) for i in range(4)}
    g = two_tier(2, 2, nic, oversubscription=1.0)
    assert g["h1"]["tor0"]["capacity"] == pytest.approx(1e9 / 8)
    assert g["tor0"]["core"]["capacity"] == pytest.approx((25e9 + 1e9) / 8)
    one = two_tier(1, 3, 8e9)
    assert "core" not in one and len(hosts(one)) == 3
    with pytest.raises(TopologyError, match="racks >= 1"):
        two_tier(0, 3, 8e9)
    with pytest.raises(TopologyError, match="h0"):
        two_tier(1, 2, {"h0": 0.0, "h1": 1.0})


@pytest.mark.parametrize("k", [2, 4, 6])
def test_fat_tree_counts_and_full_bisection(k: int) -> None:
    g = fat_tree(k, 8e9)
    assert len(hosts(g)) == k**3 // 4
    switches = [v for v, kind in g.nodes(data="kind") if kind == "switch"]
    assert len(switches) == k * k + (k // 2) ** 2  # k pods x (k/2 edge + k/2 aggregation) + core
    assert all(d == k for v, d in g.out_degree(switches))  # every switch uses its k ports
    path = PathCache(g).path("h0", f"h{k**3 // 4 - 1}")
    assert len(path) == 7 and path[3].startswith("c")  # host-edge-agg-core-agg-edge-host
    assert nx.is_strongly_connected(g)
    with pytest.raises(TopologyError, match="even k"):
        fat_tree(3, 8e9)


def test_path_cache_is_deterministic_hop_shortest_and_cached() -> None:
    g = fat_tree(4, 8e9)
    pc = PathCache(g)
    for src, dst in [("h0", "h15"), ("h3", "h4"), ("h5", "h5")]:
        assert len(pc.path(src, dst)) == len(shortest_path(g, src, dst))
    assert pc.links("h0", "h15") is pc.links("h0", "h15")
    assert PathCache(fat_tree(4, 8e9)).path("h0", "h15") == pc.path("h0", "h15")
    assert pc.same_topology(fat_tree(4, 16e9)) and not pc.same_topology(star(3, 8e9))
    with pytest.raises(TopologyError, match="'nope' is not a host"):
        pc.path("nope", "h0")
    g.add_node("island", kind="host")
    with pytest.raises(TopologyError, match="no path from 'island' to 'h0'"):
        PathCache(g).path("island", "h0")


def test_next_hop_is_the_paths_second_node_and_raises_as_path() -> None:
    g = fat_tree(4, 8e9)
    pc = PathCache(g)
    for src, dst in [("h0", "h15"), ("h3", "h4"), ("h5", "h5")]:
        path = pc.path(src, dst)
        assert pc.next_hop(src, dst) == (path[1] if len(path) > 1 else dst)
    with pytest.raises(TopologyError, match="'nope' is not a host"):
        pc.next_hop("nope", "h0")
    g.add_node("island", kind="host")
    with pytest.raises(TopologyError, match="no path from 'island' to 'h0'"):
        PathCache(g).next_hop("island", "h0")
