"""Synchronous rounds planned as a whole with their expected members (issue 23, docs/rounds.md)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

import pytest

from mlfabric.scheduler.core.graph import hosts, two_tier
from mlfabric.scheduler.policies.arrivals import KnownArrivals, LearnedArrivals
from mlfabric.scheduler.policies.base import (
    Decision,
    InFlight,
    PendingUpdate,
    PlannedAggregate,
    Send,
    Snapshot,
)
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.sim.engine import APPLIED, Simulator
from mlfabric.scheduler.sim.iteration import SyncSGD
from mlfabric.scheduler.sim.workload import ComputeModel

MB = 1_000_000


class Given:
    """A policy answering with a fixed decision (the runner's rules are under test)."""

    name = "given"

    def __init__(self, decision: Decision) -> None:
        self.decision = decision

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        return self.decision


def pending(uid: str, host: str) -> PendingUpdate:
    return PendingUpdate(uid, "j", "ps", host, host, "h0", 10, 1.0, 0, 0.0)


def test_a_held_aggregate_leaves_at_its_hold_with_the_members_it_has() -> None:
    g = two_tier(1, 3, 8e6)
    agg = PlannedAggregate("agg:h0:0", "h1", ("u1",), 10, "h0", hold_until=1.0)
    runner = DecisionRunner(Given(Decision(sends=(Send("u1", "h1", ("h1",)),), aggregates=(agg,))))
    runner.decide(Snapshot(0.0, g), [pending("u1", "h1")])
    assert [r.send.update_id for r in runner.release(0.0, {}).sends] == ["u1"]
    runner.arrived("u1")
    assert not runner.release(0.5, {})  # every member in, but held
    assert runner.next_wakeup({}) == 1.0  # the simulator and the service wake up for it
    assert [a.aggregate_id for a in runner.release(1.0, {}).aggregates] == ["agg:h0:0"]


def test_the_runner_says_when_its_next_wakeup_may_have_come_forward() -> None:
    """The service recomputes the wake-up only after a new plan, a forgotten update or an
    arrival (``wakeup_changed``), not on every transfer report."""
    g = two_tier(1, 3, 8e6)
    agg = PlannedAggregate("agg:h0:0", "h1", ("u1",), 10, "h0", hold_until=1.0)
    runner = DecisionRunner(Given(Decision(sends=(Send("u1", "h1", ("h1",)),), aggregates=(agg,))))
    runner.decide(Snapshot(0.0, g), [pending("u1", "h1")])
    assert runner.wakeup_changed() and not runner.wakeup_changed()
    runner.release(0.0, {})
    assert not runner.wakeup_changed()  # what a release takes out it acts on itself
    runner.arrived("u1")
    assert runner.wakeup_changed() and runner.next_wakeup({}) == 1.0
    runner.forget(["u9"])
    assert runner.wakeup_changed()


def test_listed_again_with_its_last_member_and_no_hold_it_leaves_when_that_one_is_in() -> None:
    g = two_tier(1, 3, 8e6)
    held = PlannedAggregate("agg:h0:0", "h1", ("u1",), 10, "h0", hold_until=5.0)
    policy = Given(Decision(sends=(Send("u1", "h1", ("h1",)),), aggregates=(held,)))
    runner = DecisionRunner(policy, dispatcher=Dispatcher(margin=0.0))
    runner.decide(Snapshot(0.0, g), [pending("u1", "h1")])
    runner.release(0.0, {})
    runner.arrived("u1")
    whole = PlannedAggregate("agg:h0:0", "h1", ("u1", "u2"), 10, "h0")
    policy.decision = Decision(sends=(Send("u2", "h1", ("h2", "s0", "h1")),), aggregates=(whole,))
    runner.decide(Snapshot(0.1, g), [pending("u2", "h2")])
    assert [r.send.update_id for r in runner.release(0.1, {}).sends] == ["u2"]
    assert not runner.release(0.2, {}).aggregates  # u2 not in yet
    runner.arrived("u2")
    assert [a.members for a in runner.release(0.3, {}).aggregates] == [("u1", "u2")]


def test_learned_arrivals_follow_each_worker_and_know_nothing_of_a_new_one() -> None:
    m = LearnedArrivals(weight=1.0)
    key = ("j", "ps")
    m.observe(key, 0, "a", 10.0)
    m.observe(key, 0, "b", 10.03)
    m.observe(key, 0, "b", 99.0)  # the same round again: counted once
    m.observe(key, 1, "a", 20.0)
    assert m.expect(key, 1, "b", now=20.0).at == pytest.approx(20.03)
    assert m.expect(key, 1, "b", now=25.0).at == 25.0  # never before now
    assert m.expect(key, 1, "c", now=20.0).spread is None
    assert m.expect(key, 2, "b", now=30.0).spread is None  # no anchor for a round not seen


def two_racks() -> tuple[object, list[str]]:
    """The issue's instance: two racks of six, 10 Gbit/s NICs, 1 Gbit/s uplinks, the server outside."""
    g = two_tier(2, 6, 10e9, oversubscription=60)
    g.add_node("ps", kind="host")
    g.add_edge("ps", "core", capacity=10e9 / 8)
    g.add_edge("core", "ps", capacity=10e9 / 8)
    return g, [h for h in hosts(g) if h != "ps"]


def sync_run(policy: object, model: ComputeModel, rounds: int = 3) -> tuple[list[float], Simulator]:
    g, workers = two_racks()
    setup = make_policy("stf+tree", sync=True)
    it = SyncSGD(model, iterations=rounds)
    sim = Simulator(
        g,
        policy,  # type: ignore[arg-type]
        it,
        server_host="ps",
        workers=workers,
        update_bytes=20 * MB,
        replan=setup.trigger,
        batch_window=300e-6,
        batch_max_wait=5e-3,
    )
    records = sim.run()
    assert len(it.makespans) == rounds
    assert all(r.outcome == APPLIED for r in records) and len(records) == rounds * len(workers)
    return it.makespans, sim


@pytest.mark.parametrize("jitter", [0.1, 0.2])
def test_rounds_under_jitter_come_within_15_percent_of_the_plan_knowing_the_arrivals(jitter: float) -> None:
    _, workers = two_racks()
    model = ComputeModel(dict.fromkeys(workers, 0.05), jitter=jitter, seed=0)
    table = model.table(3, workers)
    online, _ = sync_run(make_policy("stf+tree", sync=True).policy, model)
    known, _ = sync_run(TreePolicy(arrivals=KnownArrivals(lambda v: table[v])), model)
    fair, _ = sync_run(make_policy("fair", sync=True).policy, model)
    assert statistics.mean(online) <= 1.15 * statistics.mean(known)
    assert statistics.mean(fair) >= 2 * statistics.mean(online)
    # shown no membership, the policy plans the updates as they come: trees never form
    came = make_policy("stf+tree", sync=True).policy

    class AsTheyCome:
        name = "as-they-come"

        def decide(self, snapshot: Snapshot, p: Sequence[PendingUpdate]) -> Decision:
            return came.decide(replace(snapshot, rounds={}), p)

    before, _ = sync_run(AsTheyCome(), model)
    assert statistics.mean(before) > 1.3 * statistics.mean(online)


def test_a_straggler_does_not_hold_the_round() -> None:
    """h3 computes 10x longer: in the first round its rack's aggregate leaves without it (held
    at most one uplink payload) and it goes on its own; once learned it is planned for when it
    comes (alone, or with an update the plan has wait for it at no cost)."""
    _, workers = two_racks()
    means = dict.fromkeys(workers, 0.05) | {"h3": 0.5}
    makespans, sim = sync_run(make_policy("stf+tree", sync=True).policy, ComputeModel(means), rounds=3)
    late = [r for r in sim.records if r.worker == "h3"]
    # its own payload reaches the server one uplink transfer (0.16 s) after it is ready, or less
    assert all(r.arrived_at - r.ready_at <= 0.16 + 0.02 for r in late)
    first = next(r.update_id for r in late if r.base_version == 0)
    # the first round knew nothing of it: the aggregate expecting it left without it
    assert not [a for a in sim.aggregates if first in a.members]
    assert max(makespans) <= 0.5 + 0.16 + 0.02


def test_an_aggregate_behind_a_transfer_whose_report_is_held_wakes_the_release_at_its_expected_end() -> None:
    """A synchronous round holds the reports of its direct sends until it is applied, which may
    need the aggregate planned after such a send: the runner's wake-up releases it when the
    send is nearly done by the clock, not when its report comes (or it counts as stalled)."""
    g = two_tier(1, 3, 8e6)
    agg = PlannedAggregate("agg:h0:0", "h1", ("u1",), 10, "h0", after=("d",))
    runner = DecisionRunner(
        Given(Decision(sends=(Send("u1", "h1", ("h1",)),), aggregates=(agg,))),
        dispatcher=Dispatcher(margin=0.002),
    )
    runner.decide(Snapshot(0.0, g), [pending("u1", "h1")])
    direct = {"d": InFlight("d", "j", "ps", ("h2", "s0", "h0"), 10, 0.0, 2.0)}
    runner.release(0.0, direct)
    runner.arrived("u1")
    assert not runner.release(1.0, direct)
    assert runner.next_wakeup(direct) == pytest.approx(1.998)
    assert [a.aggregate_id for a in runner.release(1.998, direct).aggregates] == ["agg:h0:0"]
