"""The all-reduce planner for a process group: the group's own collective where the graph is
uniform (never slower than it), mlfabric's trees where they beat it by the margin."""

from __future__ import annotations

import dataclasses

import pytest

from mlfabric.scheduler.core.graph import star, two_tier
from mlfabric.scheduler.policies.allreduce import DAEMONS, PROCESS_GROUP, plan_allreduce, ring_seconds
from tests.scheduler.test_allreduce_plan import HOSTS8, check_plan

MB = 1 << 20


def _parts(hosts: list[str]) -> list[tuple[str, str]]:
    return [(f"rank{i}", h) for i, h in enumerate(hosts)]


@pytest.mark.parametrize("rate", [100e6, 1e9, 2.5e9])
@pytest.mark.parametrize("nbytes", [16 * MB, 64 * MB])
def test_uniform_graph_runs_the_native_collective(rate: float, nbytes: int) -> None:
    plan = plan_allreduce(star(HOSTS8, rate), _parts(HOSTS8), nbytes, executor=PROCESS_GROUP)
    assert plan.kind == "native"
    # the native model is a ring in rank order; the best tree lost by more than the margin
    expected = ring_seconds(star(HOSTS8, rate), HOSTS8, nbytes) / PROCESS_GROUP.efficiency
    expected += PROCESS_GROUP.op_overhead
    assert plan.seconds == pytest.approx(expected)
    assert plan.tree_model_seconds * (1 + PROCESS_GROUP.native_margin) >= plan.seconds
    assert "native collective of 8" in plan.describe(dict(_parts(HOSTS8)))


@pytest.mark.parametrize("rate", [100e6, 1e9, 2.5e9])
def test_heterogeneous_graph_runs_a_tree_with_slow_hosts_as_leaves(rate: float) -> None:
    graph = star(HOSTS8, {h: rate if i % 2 == 0 else rate / 4 for i, h in enumerate(HOSTS8)})
    parts = _parts(HOSTS8)
    plan = plan_allreduce(graph, parts, 16 * MB, executor=PROCESS_GROUP)
    check_plan(plan, parts, 16 * MB)
    assert plan.kind == "tree"
    assert plan.seconds * (1 + PROCESS_GROUP.native_margin) < plan.ring_seconds  # ring_seconds: native
    slow = {f"rank{i}" for i in range(1, 8, 2)}
    assert all(plan.children[p] == [] for p in slow)


def test_the_margin_keeps_the_native_collective_where_a_tree_is_barely_faster() -> None:
    graph = star(HOSTS8, {h: 1e9 if i % 2 == 0 else 0.25e9 for i, h in enumerate(HOSTS8)})
    parts = _parts(HOSTS8)
    tree = plan_allreduce(graph, parts, 16 * MB, executor=PROCESS_GROUP)
    assert tree.kind == "tree"
    ratio = tree.ring_seconds / tree.seconds  # native / tree
    wide = dataclasses.replace(PROCESS_GROUP, native_margin=ratio)  # the tree must beat it by more
    assert plan_allreduce(graph, parts, 16 * MB, executor=wide).kind == "native"


def test_native_ring_follows_rank_order_across_racks() -> None:
    """gloo's ring goes rank 0, 1, 2, ...: ranks alternating between two racks cross the
    oversubscribed uplinks at every hop, so a rack-aware tree wins there, and with ranks in
    rack order the native ring does."""
    graph = two_tier(2, 4, 10e9, oversubscription=4.0)
    racks = [[f"h{i}" for i in range(4)], [f"h{i}" for i in range(4, 8)]]
    in_order = _parts([*racks[0], *racks[1]])
    alternating = _parts([h for pair in zip(racks[0], racks[1], strict=True) for h in pair])
    assert plan_allreduce(graph, in_order, 64 * MB, executor=PROCESS_GROUP).kind == "native"
    crossing = plan_allreduce(graph, alternating, 64 * MB, executor=PROCESS_GROUP)
    assert crossing.kind == "tree"


def test_daemons_executor_is_unchanged() -> None:
    graph = star(HOSTS8, 100e6)
    parts = _parts(HOSTS8)
    assert plan_allreduce(graph, parts, 16 * MB) == plan_allreduce(graph, parts, 16 * MB, executor=DAEMONS)
    assert plan_allreduce(graph, parts, 16 * MB).kind == "ring"
