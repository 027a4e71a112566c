"""Multi-level aggregation trees (``stf+tree``): planner, checker, pipeline and simulator."""

from __future__ import annotations

import math

import pytest

from mlfabric.scheduler.core.checker import ScheduleError, check_schedule
from mlfabric.scheduler.core.graph import two_tier
from mlfabric.scheduler.core.schedule import Aggregate, Schedule, Transfer, Update, is_aggregate_id
from mlfabric.scheduler.policies.base import (
    Decision,
    InFlight,
    PendingUpdate,
    PlannedAggregate,
    Send,
    Snapshot,
)
from mlfabric.scheduler.policies.convert import schedule_to_decision
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.policies.stf import plan_stf
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.policies.trees import plan_tree
from mlfabric.scheduler.service.cli import build_policy
from mlfabric.scheduler.sim.engine import APPLIED, Simulator
from mlfabric.scheduler.sim.iteration import SyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel

MB = 1_000_000


def motivating() -> tuple[object, list[Update]]:
    """Two racks of six hosts, 10 Gbit/s NICs, 1 Gbit/s rack uplinks, server h0, 20 MB updates."""
    g = two_tier(2, 6, 10e9, oversubscription=60)
    assert g.edges["tor0", "core"]["capacity"] == pytest.approx(1e9 / 8)
    return g, [Update(f"u{i}", f"h{i}", "h0", 20 * MB) for i in range(1, 12)]


def three_racks_slow_server() -> tuple[object, list[Update]]:
    """Three racks at 4:1, every NIC 10 Gbit/s but the server's 1 Gbit/s: a deeper tree pays."""
    nic = {f"h{i}": 10e9 for i in range(18)}
    nic["h0"] = 1e9
    return two_tier(3, 6, nic, oversubscription=4), [
        Update(f"u{i}", f"h{i}", "h0", 20 * MB) for i in range(1, 18)
    ]


def test_the_motivating_round_sums_inside_the_far_rack() -> None:
    g, us = motivating()
    direct = plan_stf(g, us)
    tree = plan_tree(g, us)
    check_schedule(g, tree, updates=us)
    assert direct.makespan() == pytest.approx(0.96, rel=0.1)  # rack 1's six updates on its 1 Gbit/s uplink
    assert tree.makespan() <= 0.26  # the in-rack sum; the ILP found 0.32
    # one payload crosses rack 1's uplink: an aggregate of rack 1's six updates, made in rack 1
    crossing = [t for t in tree.transfers if ("tor1", "core") in t.links]
    (agg,) = [a for a in tree.aggregates if a.aggregate_id == crossing[0].payload_id]
    assert len(crossing) == 1 and agg.aggregator in {f"h{i}" for i in range(6, 12)}
    by_id = {a.aggregate_id: a for a in tree.aggregates}

    def leaves(pid: str) -> list[str]:
        return [u for m in by_id[pid].members for u in leaves(m)] if pid in by_id else [pid]

    assert sorted(leaves(agg.aggregate_id)) == sorted(f"u{i}" for i in range(6, 12))


def test_the_aggregators_own_update_needs_no_transfer() -> None:
    g, us = motivating()
    tree = plan_tree(g, us)
    by_host = {u.src: u for u in us}
    for agg in tree.aggregates:
        own = by_host.get(agg.aggregator)
        if own is None or own.update_id not in agg.members:
            continue
        t = tree.delivery(own.update_id)
        assert t is not None and t.path == (agg.aggregator,) and t.links == () and t.end == t.start
        break
    else:
        raise AssertionError("no aggregate sums its aggregator's own update")


def test_a_slow_server_gets_one_payload_from_a_two_level_tree() -> None:
    g, us = three_racks_slow_server()
    tree = plan_tree(g, us)
    result = check_schedule(g, tree, updates=us)
    nested = [a for a in tree.aggregates if any(is_aggregate_id(m) for m in a.members)]
    assert nested, "expected an aggregate of aggregates"
    into_server = [t for t in tree.transfers if t.dst == "h0"]
    assert len(into_server) == 1
    assert set(result.delays) == {u.update_id for u in us}
    assert tree.makespan() < plan_stf(g, us).makespan() / 5


def test_the_planner_restricts_aggregators() -> None:
    g, us = motivating()
    tree = plan_tree(g, us, aggregators=["h7"])
    assert [a.aggregator for a in tree.aggregates] == ["h7"]
    none = plan_tree(g, us, aggregators=[])
    assert none.aggregates == () and none.makespan() == pytest.approx(plan_stf(g, us).makespan(), rel=0.1)


def test_the_checker_refuses_a_nested_aggregate_leaving_before_its_inner_one_arrives() -> None:
    g, us = three_racks_slow_server()
    tree = plan_tree(g, us)
    outer = next(a for a in tree.aggregates if any(is_aggregate_id(m) for m in a.members))
    ends = {}
    for m in outer.members:
        t = tree.delivery(m)
        assert t is not None
        ends[m] = t.end
    *_, second, inner = sorted(outer.members, key=lambda m: ends[m])
    assert is_aggregate_id(inner) and ends[second] < ends[inner]  # the last member in is an aggregate
    start = (ends[second] + ends[inner]) / 2
    early = []
    for t in tree.transfers:
        if t.payload_id == outer.aggregate_id:
            t = Transfer.at_rate(t.payload_id, t.path, start=start, bytes=t.bytes, rate=1e3)
        early.append(t)
    with pytest.raises(ScheduleError, match=f"before member '{inner}'"):
        check_schedule(g, Schedule.aggregated(early, tree.aggregates), updates=us)


def test_the_checker_refuses_an_aggregate_in_two_trees() -> None:
    g = two_tier(1, 3, 8e6)
    us = [Update(f"u{i}", f"h{i}", "h0", 1.0) for i in (1, 2)]
    a = Aggregate("agg:h0:0", "h1", ("u1", "u2"), 1.0, "h0")
    twice = (
        Aggregate("agg:h0:1", "h2", ("agg:h0:0",), 1.0, "h0"),
        Aggregate("agg:h0:2", "h2", ("agg:h0:0",), 1.0, "h0"),
    )
    with pytest.raises(ScheduleError, match="aggregated twice"):
        check_schedule(g, Schedule(aggregates=(a, *twice)), updates=us)


def test_the_adapter_names_nested_members_by_their_decision_ids() -> None:
    g, us = three_racks_slow_server()
    tree = plan_tree(g, us)
    ids = {a.aggregate_id: f"agg:h0:{100 + i}" for i, a in enumerate(tree.aggregates)}
    d = schedule_to_decision(tree, aggregate_ids=ids)
    made = {a.aggregate_id for a in d.aggregates}
    members = {m for a in d.aggregates for m in a.members if is_aggregate_id(m)}
    assert members and members <= made
    by_id = {a.aggregate_id: a for a in d.aggregates}
    for a in d.aggregates:
        for m in a.members:
            if m in by_id:
                assert by_id[m].dst == a.aggregator and by_id[m].path[-1] == a.aggregator


def pending(i: int, size: int = 20 * MB) -> PendingUpdate:
    return PendingUpdate(f"u{i}", "j", "s", f"h{i}", f"h{i}", "h0", size, 1.0, 0, 0.0)


def test_the_policy_keeps_a_started_tree_when_it_decides_again() -> None:
    g, _ = three_racks_slow_server()
    policy = make_policy("stf+tree").policy
    runner = DecisionRunner(policy)
    first = runner.decide(Snapshot(0.0, g), [pending(i) for i in range(1, 18)])
    outer = next(a for a in first.aggregates if any(is_aggregate_id(m) for m in a.members))
    released = runner.release(0.0, {})
    gone = {r.send.update_id for r in released.sends}
    assert gone
    left = [pending(i) for i in range(1, 18) if f"u{i}" not in gone] + [pending(17, MB)][:0]
    second = runner.decide(Snapshot(0.01, g), left)
    # the tree goes on: the updates still pending go to their planned aggregators, the
    # aggregate of aggregates is still gathered
    assert outer.aggregate_id in {a.aggregate_id for a in runner.gathering}
    planned = {m: a.aggregator for a in first.aggregates for m in a.members}
    for s in second.sends:
        if s.update_id in planned:
            assert s.next_hop == planned[s.update_id]


def test_the_simulator_runs_the_tree_policy_through_the_pipeline() -> None:
    g, us = three_racks_slow_server()
    workers = sorted({u.src for u in us})
    makespans = {}
    for name in ("fair", "stf+tree"):
        setup = make_policy(name, sync=True)
        it = SyncSGD(ComputeModel(dict.fromkeys(workers, 0.0)), iterations=2)
        sim = Simulator(
            g, setup.policy, it, server_host="h0", workers=workers, update_bytes=20 * MB, replan=setup.trigger
        )
        records = sim.run()
        assert all(r.outcome == APPLIED for r in records), name
        assert len(records) == 2 * len(workers)
        makespans[name] = max(it.makespans)
    assert makespans["stf+tree"] < makespans["fair"] / 5


def test_the_service_runs_the_tree_policy() -> None:
    setup = build_policy("stf+tree", incarnation="7f3a")
    assert isinstance(setup.policy, TreePolicy)
    assert setup.policy.name == "stf+tree" and setup.policy.scope == "7f3a"


def test_tree_policy_defaults() -> None:
    assert TreePolicy().name == "stf+tree"


class _Fixed:
    """A policy answering with the decisions it is given, one per call."""

    name = "fixed"

    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)

    def decide(self, snapshot: Snapshot, pending: object) -> Decision:
        return self.decisions.pop(0)


def test_the_runner_keeps_an_aggregate_of_aggregates_once_one_of_them_started() -> None:
    g = two_tier(2, 3, 8e6)
    inner = [
        PlannedAggregate("agg:h0:0", "h1", ("u1", "u2"), MB, "h3", path=("h1", "tor0", "core", "tor1", "h3")),
        PlannedAggregate("agg:h0:1", "h4", ("u4", "u5"), MB, "h3", path=("h4", "tor1", "h3")),
    ]
    outer = PlannedAggregate(
        "agg:h0:2", "h3", ("agg:h0:0", "agg:h0:1"), MB, "h0", path=("h3", "tor1", "core", "tor0", "h0")
    )
    sends = (
        Send("u1", "h1", ("h1",)),
        Send("u2", "h1", ("h2", "tor0", "h1")),
        Send("u4", "h4", ("h4",), after=("f",)),
        Send("u5", "h4", ("h5", "tor1", "h4"), after=("f",)),
    )
    runner = DecisionRunner(_Fixed(Decision(sends=sends, aggregates=(*inner, outer)), Decision()))
    runner.decide(Snapshot(0.0, g), [pending(i, MB) for i in (1, 2, 4, 5)])
    busy = {"f": InFlight("f", "j", "s", ("h5", "tor1"), MB, 0.0, math.inf)}  # holds u4 and u5 back
    assert [r.send.update_id for r in runner.release(0.0, busy).sends] == ["u1", "u2"]
    runner.arrived("u1")
    runner.arrived("u2")
    out = runner.release(1.0, busy)
    assert [a.aggregate_id for a in out.aggregates] == ["agg:h0:0"]  # forwarded into agg:h0:2
    # a new decision listing nothing: the started tree stays, the aggregate of aggregates too
    runner.decide(Snapshot(1.0, g), [pending(i, MB) for i in (4, 5)])
    assert "agg:h0:2" in {a.aggregate_id for a in runner.gathering}


def test_an_aggregate_whose_members_all_went_away_leaves_the_aggregate_it_was_summed_into() -> None:
    inner = PlannedAggregate("agg:s:0", "x", ("u1", "u2"), 1.0, "y")
    outer = PlannedAggregate("agg:s:1", "y", ("u0", "agg:s:0"), 1.0, "ps")
    runner = DecisionRunner(TreePolicy())
    runner.adopt(Decision(aggregates=(inner, outer)))
    runner.forget(["u1", "u2"])  # e.g. their daemon went away: the inner aggregate is empty
    assert [(a.aggregate_id, a.members) for a in runner.gathering] == [("agg:s:1", ("u0",))]
    runner.arrived("u0")  # the outer one no longer waits for the inner one
    assert [a.aggregate_id for a in runner.release(0.0, {}).aggregates] == ["agg:s:1"]


def test_the_tree_policy_forgets_a_tree_once_all_its_updates_were_released() -> None:
    g = two_tier(2, 3, 8e6, oversubscription=3)
    mk = lambda i, k=0: PendingUpdate(f"u{i}.{k}", "j", "s", f"w{i}", f"h{i}", "h0", 10**6, 1.0, 0, 0.0)  # noqa: E731
    policy = TreePolicy()
    d = policy.decide(Snapshot(0.0, g), [mk(i) for i in range(1, 6)])
    assert d.aggregates and policy._committed
    policy.decide(Snapshot(1.0, g), [mk(1, 1)])  # every update of the first tree was released
    assert not any(
        m.startswith("u") and m.endswith(".0") for a in policy._committed.values() for m in a.members
    )


def test_nics_changed_in_place_under_a_new_graph_version_are_read_again() -> None:
    # TreePolicy keeps the hosts' ingress while Snapshot.graph_version stays the same (issue 24):
    # the same decisions as a policy that reads them every time (graph_version None); with the
    # old ingress (the NICs of h3, h4, h8 below changed), the moves between aggregates differ
    g = two_tier(2, 6, 10e9, oversubscription=60)
    sizes = {2: 5, 5: 20, 11: 5, 8: 20, 7: 5, 4: 5, 6: 5, 10: 5, 1: 5, 3: 5, 9: 5}
    late = {5, 7, 9, 10, 11}
    pending = [
        PendingUpdate(f"u{i}", "j", "s", f"h{i}", f"h{i}", "h0", b * MB, 1.0, 0, 0.001 if i in late else 0.0)
        for i, b in sizes.items()
    ]
    changes = [{}, {4: 4.0, 8: 0.25, 10: 1.0, 11: 1.0, 3: 0.25, 2: 1.0}, {4: 1.0, 8: 4.0, 3: 1.0}]
    kept, fresh = TreePolicy(), TreePolicy()
    for version, change in enumerate(changes):
        for i, factor in change.items():  # the producer changes NICs of the same graph object, and the number
            tor = next(iter(g.predecessors(f"h{i}")))
            g.edges[tor, f"h{i}"]["capacity"] = factor * 10e9 / 8
        for _ in range(2):  # the second time: nothing changed, nothing read again
            want = fresh.decide(Snapshot(0.0, g), pending)
            assert kept.decide(Snapshot(0.0, g, graph_version=version), pending) == want, f"version {version}"
