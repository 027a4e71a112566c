"""The all-reduce planner (scheduler/policies/allreduce.py): a ring where the graph is uniform,
bandwidth-aware trees where it is not (chains where a tree must be one), chunk sizes from the
model, and well-formed plans."""

from __future__ import annotations

import math

import pytest

from mlfabric.scheduler.core.graph import PathCache, star, two_tier
from mlfabric.scheduler.policies.allreduce import (
    CHUNK_OVERHEAD_SECONDS,
    AllreducePlan,
    plan_allreduce,
    ring_chunk_seconds,
    ring_seconds,
    tree_seconds,
)

MB = 1 << 20
HOSTS8 = [f"h{i}" for i in range(8)]
UNIFORM = star(HOSTS8, 100e6)
HETERO = star(HOSTS8, {h: 100e6 if i % 2 == 0 else 25e6 for i, h in enumerate(HOSTS8)})
HOSTS12 = [f"h{i}" for i in range(12)]


def _one_per_host(hosts: list[str]) -> list[tuple[str, str]]:
    return [(f"rank{i}", h) for i, h in enumerate(hosts)]


def check_plan(plan: AllreducePlan, participants: list[tuple[str, str]], nbytes: int) -> None:
    """What the daemons rely on: one tree over exactly the participants, consistent both ways."""
    names = {p for p, _ in participants}
    assert set(plan.parent) == names and set(plan.children) == names
    assert [p for p, q in plan.parent.items() if q is None] == [plan.root]
    for p, q in plan.parent.items():
        if q is not None:
            assert q in names and q != p
            assert plan.children[q].count(p) == 1
    assert sum(len(c) for c in plan.children.values()) == len(names) - 1
    for p in names:  # every participant reaches the root (no cycle)
        seen: set[str] = set()
        q = p
        while (up := plan.parent[q]) is not None:
            assert q not in seen
            seen.add(q)
            q = up
        assert q == plan.root
    assert 1 <= plan.chunk_bytes <= max(1, nbytes)
    assert math.isfinite(plan.seconds) and plan.seconds >= 0
    assert math.isfinite(plan.ring_seconds) and plan.ring_seconds >= 0
    assert math.isfinite(plan.tree_model_seconds)
    if plan.kind == "ring":  # every participant once, a host's participants next to each other
        assert sorted(plan.ring) == sorted(names) and len(plan.ring) >= 2
        hosts = dict(participants)
        runs = [
            h for i, h in enumerate(hosts[p] for p in plan.ring) if i == 0 or hosts[plan.ring[i - 1]] != h
        ]
        assert len(runs) == len(set(runs))
        assert plan.chunk_bytes <= math.ceil(nbytes / len(plan.ring))
        assert plan.seconds == plan.ring_seconds < plan.tree_model_seconds
    else:
        assert plan.kind == "tree" and plan.ring == ()
        assert plan.seconds == plan.tree_model_seconds <= plan.ring_seconds or plan.ring_seconds == 0


def _edges_per_participant(plan: AllreducePlan) -> dict[str, int]:
    return {p: len(plan.children[p]) + (plan.parent[p] is not None) for p in plan.parent}


@pytest.mark.parametrize("nbytes", [4 * MB, 16 * MB, 64 * MB])
def test_uniform_star_gets_a_ring_and_its_best_tree_is_a_chain(nbytes: int) -> None:
    parts = _one_per_host(HOSTS8)
    hosts = dict(parts)
    plan = plan_allreduce(UNIFORM, parts, nbytes)
    check_plan(plan, parts, nbytes)
    assert plan.kind == "ring" and plan.describe(hosts).startswith("ring of 8: ")
    # the ring moves 2 (N-1)/N B per NIC where a chain's inner hosts move 2 B: with its frames'
    # cost it stays within 15 % of the ideal ring, and beats the chain by more than 8/7
    ideal = ring_seconds(UNIFORM, HOSTS8, nbytes)
    assert ideal < plan.seconds < 1.15 * ideal
    assert plan.tree_model_seconds > plan.seconds * 8 / 7
    # the best tree is still the chain, which beats every fan-out tree at any chunk size
    assert plan.shape.startswith("chain-"), plan.shape
    assert max(_edges_per_participant(plan).values()) == 2  # a path
    assert plan.depth() == 4  # rooted in the middle of 8
    order = [p for p, _ in parts]
    pc = PathCache(UNIFORM)
    for d in (2, 3, 7):
        heap = {v: (None if i == 0 else order[(i - 1) // d]) for i, v in enumerate(order)}
        for chunk in (64 << 10, 256 << 10, 1 * MB, 4 * MB):
            assert plan.tree_model_seconds < tree_seconds(UNIFORM, heap, hosts, nbytes, chunk, pc)


def test_ring_chunks_trade_the_last_hop_against_frames() -> None:
    parts = _one_per_host(HOSTS8)
    hosts = dict(parts)
    plan = plan_allreduce(UNIFORM, parts, 16 * MB)
    assert plan.kind == "ring" and plan.chunk_bytes <= 2 * MB  # within a segment of 16 MB / 8
    for chunk in (64 << 10, 2 * MB):  # many frames / a long last hop: both slower
        forced = plan_allreduce(UNIFORM, parts, 16 * MB, chunk_bytes=chunk)
        check_plan(forced, parts, 16 * MB)
        assert forced.chunk_bytes == chunk and forced.seconds > plan.seconds
    # the model: 2 (N-1)/N B on every NIC, one chunk's hop, 4 (N-1) frame ends per chunk of a segment
    t = ring_chunk_seconds(UNIFORM, plan.ring, hosts, 16 * MB, 1 * MB)
    expected = 2 * 7 / 8 * 16 * MB / 12.5e6 + MB / 12.5e6 + 4 * 7 * 2 * CHUNK_OVERHEAD_SECONDS
    assert t == pytest.approx(expected)


def test_small_payloads_and_single_hosts_keep_a_tree() -> None:
    parts = _one_per_host(HOSTS8)
    assert plan_allreduce(UNIFORM, parts, 1000).kind == "tree"  # the ring's 28 frames cost more
    same_host = [(f"p{i}", "h0") for i in range(4)]
    plan = plan_allreduce(UNIFORM, same_host, 16 * MB)
    check_plan(plan, same_host, 16 * MB)
    assert plan.kind == "tree"  # no network either way: one frame per chunk and edge wins


@pytest.mark.parametrize("nbytes", [4 * MB, 16 * MB])
def test_heterogeneous_star_keeps_the_bandwidth_aware_tree(nbytes: int) -> None:
    parts = _one_per_host(HOSTS8)
    hosts = dict(parts)
    plan = plan_allreduce(HETERO, parts, nbytes)
    check_plan(plan, parts, nbytes)
    assert plan.kind == "tree" and plan.describe(hosts).startswith("tree ")
    assert not plan.shape.startswith("chain-"), plan.shape
    slow = [p for p, h in hosts.items() if int(h[1:]) % 2]
    assert all(plan.children[p] == [] for p in slow)  # slow hosts are leaves
    assert plan.seconds < plan.ring_seconds / 1.3


def test_two_racks_ring_at_4_to_1_chain_at_8_to_1_each_crossing_racks_least() -> None:
    parts = _one_per_host([f"h{i}" for i in range(8)])
    hosts = dict(parts)

    def rack(p: str) -> int:
        return int(hosts[p][1:]) // 4

    # 4:1 (uplinks as fast as a NIC): the ring's 2 (N-1)/N B per uplink direction beats the
    # chain's 2 B through its inner NICs; racks contiguous, so the ring crosses each way once
    ring = plan_allreduce(two_tier(2, 4, 100e6, oversubscription=4), parts, 16 * MB)
    check_plan(ring, parts, 16 * MB)
    assert ring.kind == "ring"
    assert sum(rack(p) != rack(ring.ring[i - 1]) for i, p in enumerate(ring.ring)) == 2
    # 8:1: an uplink at half a NIC; the ring would move 1.75 B over it, the chain B
    g = two_tier(2, 4, 100e6, oversubscription=8)
    plan = plan_allreduce(g, parts, 16 * MB)
    check_plan(plan, parts, 16 * MB)
    assert plan.kind == "tree" and plan.shape.startswith("chain-")
    crossings = [p for p, q in plan.parent.items() if q is not None and rack(p) != rack(q)]
    assert len(crossings) == 1
    assert plan.seconds < ring_seconds(g, [f"h{i}" for i in range(8)], 16 * MB)


@pytest.mark.parametrize(
    ("graph", "hosts"),
    [
        (star(["a"], 1e9), ["a"]),
        (star(["a", "b"], 1e9), ["a", "b"]),
        (star(["a", "b", "c"], {"a": 1e9, "b": 1e8, "c": 1e9}), ["a", "b", "c"]),
        (UNIFORM, HOSTS8),
        (HETERO, HOSTS8),
        (two_tier(3, 4, 1e9, oversubscription=2), [f"h{i}" for i in range(12)]),
        (
            two_tier(2, 6, {f"h{i}": 1e10 if i < 3 else 1e9 for i in range(12)}, 4),
            [f"h{i}" for i in range(12)],
        ),
        (star([f"h{i}" for i in range(17)], 1e9), [f"h{i}" for i in range(17)]),
    ],
)
@pytest.mark.parametrize("nbytes", [0, 1, 1000, 4 * MB, 64 * MB])
def test_every_plan_is_one_tree_over_the_participants(graph, hosts: list[str], nbytes: int) -> None:
    parts = _one_per_host(hosts)
    plan = plan_allreduce(graph, parts, nbytes)
    check_plan(plan, parts, nbytes)
    # two participants per host: the second chains under the first at no network cost
    doubled = parts + [(f"x{i}", h) for i, h in enumerate(hosts)]
    plan2 = plan_allreduce(graph, doubled, nbytes)
    check_plan(plan2, doubled, nbytes)
    assert all(plan2.parent[f"x{i}"] == f"rank{i}" for i in range(len(hosts)))


def test_planner_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="at least one participant"):
        plan_allreduce(UNIFORM, [], 10)
    with pytest.raises(ValueError, match=r"listed twice.*'p'"):
        plan_allreduce(UNIFORM, [("p", "h0"), ("p", "h1")], 10)
    with pytest.raises(ValueError, match=r"not in the bandwidth graph.*'zz'"):
        plan_allreduce(UNIFORM, [("p", "zz")], 10)
