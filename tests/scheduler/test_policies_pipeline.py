"""The decision pipeline: Schedule -> Decision adapter, policy factory, DecisionRunner."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.core.schedule import Aggregate, Schedule, Transfer, aggregate_id, is_aggregate_id
from mlfabric.scheduler.policies.aggregation import AggregationPolicy
from mlfabric.scheduler.policies.base import (
    Decision,
    Drop,
    InFlight,
    PendingUpdate,
    PlannedAggregate,
    ReplicaSend,
    Send,
    Snapshot,
)
from mlfabric.scheduler.policies.convert import schedule_to_decision
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import POLICIES, PolicySetup, make_policy
from mlfabric.scheduler.policies.runner import DecisionError, DecisionRunner
from mlfabric.scheduler.policies.stf import STFPolicy

MB = 10**6


def pending(uid: str, host: str = "w0", size: int = MB) -> PendingUpdate:
    return PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)


def flying(uid: str, end: float = math.inf) -> InFlight:
    return InFlight(uid, "j", "s", ("w0", "ps"), MB, 0.0, end)


class Fixed:
    """A policy answering with the decisions it is given, one per call."""

    name = "fixed"

    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        return self.decisions.pop(0)


SNAP = Snapshot(0.0, star(["ps", "w0", "x"], 8 * MB))
AGG = PlannedAggregate("agg:ps:0", "x", ("m1", "m2"), MB, "ps", after=("a",), path=("x", "sw", "ps"))
PLAN = Decision(
    sends=(
        Send("a", "ps", ("w0", "sw", "ps")),
        Send("m1", "x", ("w0", "sw", "x")),
        Send("m2", "x", ("w0", "sw", "x")),
        Send("b", "ps", ("w0", "sw", "ps"), after=("agg:ps:0",)),
    ),
    aggregates=(AGG,),
)
PENDING = [pending(u) for u in ("a", "m1", "m2", "b")]


def runner(*decisions: Decision) -> DecisionRunner:
    return DecisionRunner(Fixed(*decisions), dispatcher=Dispatcher(margin=0.0))


def ids(released: object) -> list[str]:
    return [r.send.update_id for r in released.sends]  # type: ignore[attr-defined]


# ------------------------------------------------------------------------ the runner


def test_an_aggregate_leaves_once_its_members_are_in_and_its_after_is_done() -> None:
    r = runner(PLAN)
    r.decide(SNAP, PENDING)
    assert ids(r.release(0.0, {})) == ["a", "m1", "m2"]  # b waits for the aggregate
    on_net = {u: flying(u) for u in ("a", "m1", "m2")}
    assert not r.release(1.0, on_net)
    r.arrived("m1")
    r.arrived("m2")
    assert not r.release(1.0, {"a": flying("a")})  # its after, a, is still moving
    out = r.release(2.0, {})
    assert out.aggregates == (AGG,) and out.sends == ()  # b follows the aggregate's transfer
    assert r.gathering == ()
    assert not r.release(2.5, {"agg:ps:0": flying("agg:ps:0")})
    assert ids(r.release(3.0, {})) == ["b"]


def test_a_send_after_a_gathered_aggregate_waits_even_with_a_margin() -> None:
    r = DecisionRunner(Fixed(PLAN), dispatcher=Dispatcher(margin=1.0))
    r.decide(SNAP, PENDING)
    r.release(0.0, {})
    assert r.next_wakeup({u: flying(u, 5.0) for u in ("a", "m1", "m2")}) is None
    assert not r.release(100.0, {})


def test_a_new_decision_replaces_an_aggregate_none_of_whose_members_left() -> None:
    other = PlannedAggregate("agg:ps:1", "x", ("m1", "m2"), MB, "ps")
    members = PLAN.sends[1:3]
    r = runner(Decision(sends=members, aggregates=(AGG,)), Decision(sends=members, aggregates=(other,)))
    r.decide(SNAP, PENDING[1:3])  # only the members: none released yet
    r.decide(SNAP, PENDING[1:3])
    assert [a.aggregate_id for a in r.gathering] == ["agg:ps:1"]
    assert r.aggregate_of("m1") == other


def test_an_aggregate_a_member_of_which_left_is_kept() -> None:
    rest = Decision(sends=(Send("m2", "x", ("w0", "sw", "x")),))
    r = runner(Decision(sends=PLAN.sends[1:2], aggregates=(AGG,)), rest)
    r.decide(SNAP, PENDING[1:3])
    assert ids(r.release(0.0, {})) == ["m1"]
    r.decide(SNAP, PENDING[2:3])  # m2 still pending; the aggregate is not listed again
    assert [a.aggregate_id for a in r.gathering] == ["agg:ps:0"]
    assert ids(r.release(0.0, {"m1": flying("m1")})) == ["m2"]


def test_a_dropped_member_no_longer_holds_its_aggregate() -> None:
    r = runner(PLAN)
    r.decide(SNAP, PENDING)
    r.release(0.0, {})
    r.arrived("m1")
    r.forget(["m2"])  # e.g. its daemon left
    assert r.release(1.0, {}).aggregates == (PlannedAggregate(**{**AGG.__dict__, "members": ("m1",)}),)


def test_an_aggregate_whose_members_all_left_is_forgotten_and_frees_its_followers() -> None:
    r = runner(Decision(sends=(PLAN.sends[1], PLAN.sends[3]), aggregates=(AGG,)))
    r.decide(SNAP, [pending("m1"), pending("b")])
    r.forget(["m1", "m2"])
    assert r.gathering == () and ids(r.release(0.0, {})) == ["b"]


def test_decision_drops_leave_the_plan() -> None:
    r = runner(Decision(sends=PLAN.sends[:1], drops=(Drop("m1", "stale"),), aggregates=(AGG,)))
    d = r.decide(SNAP, PENDING[:3])
    assert d.drops == (Drop("m1", "stale"),)
    assert r.aggregate_of("m2") == PlannedAggregate(**{**AGG.__dict__, "members": ("m2",)})


def test_a_send_of_an_update_not_pending_is_refused() -> None:
    r = runner(Decision(sends=(Send("ghost", "ps", ("w0", "sw", "ps")),)))
    with pytest.raises(DecisionError, match="'ghost', which is not pending"):
        r.decide(SNAP, PENDING[:1])


def test_nothing_pending_does_not_call_the_policy() -> None:
    r = runner()  # a call would pop from an empty list
    assert r.decide(SNAP, []) == Decision() and r.decisions == 0


def test_the_trigger_asks_again_when_a_bounded_plan_runs_out() -> None:
    setup = make_policy("stf", horizon=1)
    r = DecisionRunner(setup.policy, dispatcher=Dispatcher(margin=0.0), trigger=setup.trigger)
    ups = [pending("u1", "w0"), pending("u2", "x", 2 * MB)]
    assert [s.update_id for s in r.decide(SNAP, ups).sends] == ["u1"]
    assert not r.moved(pending=2)  # one planned (low water 0), nothing released yet
    assert ids(r.release(0.0, {})) == ["u1"]
    assert r.moved(pending=1)  # u2 is unplanned and nothing is planned


# ------------------------------------------------------------------------ the adapter


def test_the_adapter_never_makes_a_cycle_of_zero_length_transfers() -> None:
    a = Transfer("a", "w0", "ps", ("w0", "ps"), 1.0, 1.0, 0)
    b = Transfer("b", "w0", "ps", ("w0", "ps"), 1.0, 1.0, 0)
    d = schedule_to_decision(Schedule((a, b)))
    assert [s.after for s in d.sends] == [(), ("a",)]


def test_the_adapter_turns_replica_transfers_into_replica_sends() -> None:
    t = Transfer.at_rate("u", ("w0", "ps"), start=0, bytes=1, rate=1)
    copy = Transfer.at_rate("u", ("w0", "r"), start=0, bytes=1, rate=1, replica=True)
    d = schedule_to_decision(Schedule((t, copy)))
    assert [s.update_id for s in d.sends] == ["u"]
    assert d.replicas == (ReplicaSend("u", "w0", "r", ("w0", "r"), (), 0.0, 1.0),)


def test_a_decision_has_room_for_replica_sends() -> None:
    assert Decision().replicas == ()


def test_aggregate_ids_are_unique_across_decisions() -> None:
    hs = ["ps", "w0", "w1", "w2", "w3", "x"]
    g = star(hs, {"ps": 8 * MB, **{h: 32 * MB for h in hs[1:]}})
    policy = AggregationPolicy(aggregators=["x"])
    mk = lambda i: PendingUpdate(f"u{i}", "j", "s", f"w{i % 4}", f"w{i % 4}", "ps", MB, 1.0, 0, 0.0)  # noqa: E731
    first = policy.decide(Snapshot(0.0, g), [mk(i) for i in range(4)])
    second = policy.decide(Snapshot(0.0, g), [mk(i) for i in range(4, 8)])
    got = [a.aggregate_id for d in (first, second) for a in d.aggregates]
    assert got == [aggregate_id("ps", 0), aggregate_id("ps", 1)]
    assert all(is_aggregate_id(a) for a in got)


def test_a_restarted_schedulers_aggregate_ids_differ_from_the_first_runs() -> None:
    """Two runs (two policy objects) on the same input: the scope keeps their ids apart."""
    from mlfabric.scheduler.core.graph import two_tier

    hs = ["ps", "w0", "w1", "w2", "w3", "x"]
    g = star(hs, {"ps": 8 * MB, **{h: 32 * MB for h in hs[1:]}})
    mk = lambda i: PendingUpdate(f"u{i}", "j", "s", f"w{i % 4}", f"w{i % 4}", "ps", MB, 1.0, 0, 0.0)  # noqa: E731
    t = two_tier(2, 3, 8e6, oversubscription=3)
    mt = lambda i: PendingUpdate(f"u{i}", "j", "s", f"w{i}", f"h{i}", "h0", MB, 1.0, 0, 0.0)  # noqa: E731
    for name, graph, updates, server in (
        ("stf+agg", g, [mk(i) for i in range(4)], "ps"),
        ("stf+tree", t, [mt(i) for i in range(1, 6)], "h0"),
    ):
        runs = [
            make_policy(name, aggregators=None if name == "stf+tree" else ["x"], scope=scope).policy
            for scope in ("1a2b", "9c8d")
        ]
        ids = [[a.aggregate_id for a in p.decide(Snapshot(0.0, graph), updates).aggregates] for p in runs]
        assert ids[0] and ids[1], name
        assert ids[0] == [aggregate_id(f"{server}.1a2b", i) for i in range(len(ids[0]))], name
        assert not set(ids[0]) & set(ids[1]), name


def test_the_planner_spells_aggregate_ids_with_the_helper() -> None:
    hs = ["ps", "w0", "w1", "w2", "w3", "x"]
    g = star(hs, {"ps": 8 * MB, **{h: 32 * MB for h in hs[1:]}})
    from mlfabric.scheduler.core.schedule import Update
    from mlfabric.scheduler.policies.aggregation import plan_aggregation

    plan = plan_aggregation(g, [Update(f"u{i}", f"w{i}", "ps", MB) for i in range(4)], aggregators=["x"])
    assert [a.aggregate_id for a in plan.aggregates] == [aggregate_id("ps", 0)]
    assert isinstance(plan.aggregates[0], Aggregate)


# ------------------------------------------------------------------------ the factory


def test_the_factory_builds_every_registered_policy_with_its_trigger() -> None:
    for name in POLICIES:
        setup = make_policy(name)
        assert isinstance(setup, PolicySetup) and setup.policy.name == name
    policy, trigger = make_policy("stf", horizon=8)
    assert isinstance(policy, STFPolicy) and (policy.horizon, trigger.low_water) == (8, 2)
    agg = make_policy("stf+agg", aggregators=["x"], sync=False).policy
    assert isinstance(agg, AggregationPolicy) and (agg.aggregators, agg.sync) == (("x",), False)


def test_the_factory_names_the_problem() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'lifo' \(known: fair, stf, stf\+agg, stf\+tree\)"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="horizon must be >= 0"):
        make_policy("stf", horizon=-1)


def test_a_kept_aggregate_stops_waiting_for_an_update_replanned_after_it() -> None:
    # the racks testbed's stall: the first plan sends "a" straight to the server (after a
    # transfer in flight, "z") and the aggregate after "a"; the aggregate's members leave, so a
    # second decision cannot replace it, and it plans "a" anew after the aggregate (gathering:
    # in flight, no known end). Each would wait for the other until the round timed out.
    z = InFlight("z", "j", "s", ("w0", "sw", "ps"), MB, 0.0, 5.0)
    first = Decision(
        sends=(
            Send("a", "ps", ("w0", "sw", "ps"), after=("z",)),
            Send("m1", "x", ("w0", "sw", "x")),
            Send("m2", "x", ("w0", "sw", "x")),
        ),
        aggregates=(replace(AGG, after=("a",)),),
    )
    second = Decision(sends=(Send("a", "ps", ("w0", "sw", "ps"), after=("agg:ps:0",)),))
    r = runner(first, second)
    r.decide(SNAP, PENDING[:3])
    assert ids(r.release(0.0, {"z": z})) == ["m1", "m2"]  # "a" waits for "z"
    r.decide(SNAP, PENDING[:1])
    assert r.broken_waits == 1
    r.arrived("m1")
    r.arrived("m2")
    released = r.release(1.0, {"z": z})
    assert [a.aggregate_id for a in released.aggregates] == ["agg:ps:0"]  # no longer waits for "a"
    assert ids(r.release(6.0, {})) == ["a"]
    # a wait that is no cycle stays: an aggregate after a send planned after something else
    r2 = runner(first, replace(second, sends=(Send("a", "ps", ("w0", "sw", "ps"), after=("z",)),)))
    r2.decide(SNAP, PENDING[:3])
    r2.release(0.0, {"z": z})
    r2.decide(SNAP, PENDING[:1])
    r2.arrived("m1")
    r2.arrived("m2")
    assert r2.broken_waits == 0 and not r2.release(1.0, {"z": z}).aggregates
