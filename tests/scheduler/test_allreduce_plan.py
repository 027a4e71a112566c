"""The all-reduce planner (scheduler/policies/allreduce.py): chains where the graph is uniform,
bandwidth-aware trees where it is not, chunk sizes from the model, and well-formed plans."""

from __future__ import annotations

import math

import pytest

from mlfabric.scheduler.core.graph import PathCache, star, two_tier
from mlfabric.scheduler.policies.allreduce import (
    AllreducePlan,
    plan_allreduce,
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
        seen, q = set(), p
        while plan.parent[q] is not None:
            assert q not in seen
            seen.add(q)
            q = plan.parent[q]
        assert q == plan.root
    assert 1 <= plan.chunk_bytes <= max(1, nbytes)
    assert math.isfinite(plan.seconds) and plan.seconds >= 0
    assert math.isfinite(plan.ring_seconds) and plan.ring_seconds >= 0


def _edges_per_participant(plan: AllreducePlan) -> dict[str, int]:
    return {p: len(plan.children[p]) + (plan.parent[p] is not None) for p in plan.parent}


@pytest.mark.parametrize("nbytes", [4 * MB, 16 * MB, 64 * MB])
def test_uniform_star_gets_a_chain_that_beats_the_fan_out_trees(nbytes: int) -> None:
    parts = _one_per_host(HOSTS8)
    hosts = dict(parts)
    plan = plan_allreduce(UNIFORM, parts, nbytes)
    check_plan(plan, parts, nbytes)
    assert plan.shape.startswith("chain-"), plan.shape
    assert max(_edges_per_participant(plan).values()) == 2  # a path
    assert plan.depth() == 4  # rooted in the middle of 8
    # the chain beats every fan-out tree under the model, whatever their chunk size
    order = [p for p, _ in parts]
    pc = PathCache(UNIFORM)
    for d in (2, 3, 7):
        heap = {v: (None if i == 0 else order[(i - 1) // d]) for i, v in enumerate(order)}
        for chunk in (64 << 10, 256 << 10, 1 * MB, 4 * MB):
            assert plan.seconds < tree_seconds(UNIFORM, heap, hosts, nbytes, chunk, pc)
    # 2 B per inner host against the ring's 2 (N-1)/N B: at most 7/8 of the ring's speed, less
    # the fill and the chunks' overhead (which the ring's model leaves out)
    assert plan.seconds > plan.ring_seconds * 8 / 7
    assert plan.ring_seconds / plan.seconds > 0.6


def test_uniform_chain_uses_small_chunks_for_a_short_fill() -> None:
    parts = _one_per_host(HOSTS8)
    plan = plan_allreduce(UNIFORM, parts, 16 * MB)
    assert plan.chunk_bytes <= 256 << 10
    forced = plan_allreduce(UNIFORM, parts, 16 * MB, chunk_bytes=2 * MB)
    check_plan(forced, parts, 16 * MB)
    assert forced.chunk_bytes == 2 * MB and forced.seconds > plan.seconds


@pytest.mark.parametrize("nbytes", [4 * MB, 16 * MB])
def test_heterogeneous_star_keeps_the_bandwidth_aware_tree(nbytes: int) -> None:
    parts = _one_per_host(HOSTS8)
    hosts = dict(parts)
    plan = plan_allreduce(HETERO, parts, nbytes)
    check_plan(plan, parts, nbytes)
    assert not plan.shape.startswith("chain-"), plan.shape
    slow = [p for p, h in hosts.items() if int(h[1:]) % 2]
    assert all(plan.children[p] == [] for p in slow)  # slow hosts are leaves
    assert plan.seconds < plan.ring_seconds / 1.3


def test_two_racks_chain_crosses_between_racks_once() -> None:
    g = two_tier(2, 4, 100e6, oversubscription=4)
    parts = _one_per_host([f"h{i}" for i in range(8)])
    hosts = dict(parts)
    plan = plan_allreduce(g, parts, 16 * MB)
    check_plan(plan, parts, 16 * MB)
    assert plan.shape.startswith("chain-")

    def rack(p: str) -> int:
        return int(hosts[p][1:]) // 4

    crossings = [p for p, q in plan.parent.items() if q is not None and rack(p) != rack(q)]
    assert len(crossings) == 1
    assert plan.seconds < ring_seconds(g, [f"h{i}" for i in (0, 4, 1, 5, 2, 6, 3, 7)], 16 * MB)


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
