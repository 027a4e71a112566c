"""Two-level routes in the ILP (plan/ilp_relays.py): an aggregate summed into another one."""

from __future__ import annotations

from typing import Any

import pytest

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.schedule import is_aggregate_id
from mlfabric.scheduler.plan.heuristics import heuristic_plans, warm_start
from mlfabric.scheduler.plan.ilp import solve_ilp
from mlfabric.scheduler.plan.instance import objective_of, parse_instance
from mlfabric.scheduler.policies.trees import plan_tree


def two_racks_slow_server() -> dict[str, Any]:
    """Two racks of three workers and an aggregator (10 Gbit/s), the server behind 2.5 Gbit/s.

    One update is one 10 ms slot at 10 Gbit/s and four slots into the server. One level:
    at best an update direct (slots 0-3) while one aggregator takes the other five (slots
    0-4) and forwards them (5-8): 90 ms. Two levels: each rack summed at its aggregator
    (slots 0-2), rack 1's aggregate into a0 (slot 3), one payload to the server (4-7): 80 ms.
    """
    rack = {"w0": 0, "w1": 0, "w4": 0, "a0": 0, "w2": 1, "w3": 1, "w5": 1, "a1": 1}
    links = [{"a": "s0", "b": "tor_s", "gbps": 2.5}, {"a": "tor_s", "b": "core", "gbps": 10}]
    links += [{"a": f"tor{r}", "b": "core", "gbps": 10} for r in (0, 1)]
    links += [{"a": h, "b": f"tor{r}", "gbps": 10} for h, r in rack.items()]
    return {
        "topology": {"hosts": ["s0", *rack], "switches": ["core", "tor_s", "tor0", "tor1"], "links": links},
        "server": "s0",
        "aggregators": ["a0", "a1"],
        "slot_seconds": 0.01,
        "objective": "makespan",
        "updates": [{"id": f"u{i}", "worker": f"w{i}", "bytes": 12_500_000} for i in range(6)],
    }


def test_two_levels_beat_one_and_match_the_tree() -> None:
    inst = parse_instance(two_racks_slow_server())
    updates = list(inst.updates)
    hint = warm_start(inst, heuristic_plans(inst).values())
    one = solve_ilp(inst, hint=hint, time_limit=30, workers=2, levels=1)
    two = solve_ilp(inst, hint=hint, time_limit=30, workers=2, levels=2)
    assert one.schedule is not None and two.schedule is not None
    check_schedule(inst.graph, one.schedule, updates=updates)
    check_schedule(inst.graph, two.schedule, updates=updates)
    assert one.objective == pytest.approx(0.09)
    assert two.objective == pytest.approx(0.08)
    assert two.status == "OPTIMAL"
    assert any(is_aggregate_id(m) for a in two.schedule.aggregates for m in a.members)
    assert not any(is_aggregate_id(m) for a in one.schedule.aggregates for m in a.members)
    # aggregates carry the updates: fewer payloads reach the server than there are updates
    # (the optimum is not unique: one payload, or one update direct and the rest summed, both
    # finish at 0.08 s; the parallel solver may return either)
    assert len([t for t in two.schedule.transfers if t.dst == "s0"]) < len(updates)
    tree = plan_tree(inst.graph, updates, aggregators=list(inst.aggregators))
    check_schedule(inst.graph, tree, updates=updates)
    assert objective_of(inst, tree) == pytest.approx(0.08)
    assert len([t for t in tree.transfers if t.dst == "s0"]) == 1  # the tree: one payload


def test_levels_is_one_or_two() -> None:
    inst = parse_instance(two_racks_slow_server())
    with pytest.raises(ValueError, match="levels must be 1 or 2, got 3"):
        solve_ilp(inst, levels=3)
