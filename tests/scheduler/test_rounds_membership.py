"""An update is a member of one aggregate at a time, whatever the rounds' arrival orders.

Workers of a synchronous server may push several updates computed from the same model
version (a round takes one of each worker; the others are planned like asynchronous ones).
The tree policy's round book and its committed trees must never both claim an update: an
aggregate that lists a member sent elsewhere waits for it until its aggregator's timeout, and
the round behind it stalls (the ``sync-rounds`` end-to-end test once did, for two minutes).
The round book's rule is pinned on the stalled run's case (the last test); the decision runner
is also driven as the service drives it — sends released, transfers ending, members in at
their aggregators, aggregates forwarded — over random arrival orders (w3 never fetches a newer
model, as in the stalled run), and after every decision each update is in at most one
aggregate and every member released goes to the aggregator of the aggregate the runner has
it in. (The random orders did not reach the stalled run's state in 4,800 decisions; they
guard the invariant across the pipeline.)
"""

from __future__ import annotations

import random

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, PlannedAggregate, RoundSpec, Snapshot
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.policies.tree_policy import TreePolicy

#: the end-to-end test's topology: two racks with an aggregator each, the server behind a slow link
LINKS = [
    ("ps", "core", 10),
    ("ra", "core", 40),
    ("rb", "core", 40),
    *((h, "ra", 1000) for h in ("a0", "a1", "ax")),
    *((h, "rb", 1000) for h in ("b0", "b1", "bx")),
]
WORKERS = {"w0": "a0", "w1": "a1", "w2": "b0", "w3": "b1"}


def racks() -> nx.DiGraph:
    g = nx.DiGraph()
    for a, b, mbps in LINKS:
        for u, v in ((a, b), (b, a)):
            g.add_edge(u, v, capacity=mbps * 1e6 / 8)
    for n in g.nodes:
        g.nodes[n]["kind"] = "switch" if n in ("core", "ra", "rb") else "host"
    return g


def memberships(runner: DecisionRunner) -> dict[str, list[str]]:
    """Update (or aggregate) id -> the aggregates at the runner that list it."""
    out: dict[str, list[str]] = {}
    for a in runner.gathering:
        for m in a.members:
            out.setdefault(m, []).append(a.aggregate_id)
    return out


def drive(seed: int, steps: int = 400) -> int:
    """Random pushes of 4 workers (bursts computed from one model version); checks after every
    decision; returns the aggregates forwarded."""
    rng = random.Random(seed)
    g = racks()
    setup = make_policy("stf+tree", sync=True)
    runner = DecisionRunner(setup.policy, dispatcher=Dispatcher(margin=0.0), trigger=setup.trigger)
    spec = RoundSpec(WORKERS)
    pending: dict[str, PendingUpdate] = {}
    seq = dict.fromkeys(WORKERS, 0)
    version = dict.fromkeys(WORKERS, 0)
    forwarded = 0
    now = 0.0
    flying: dict[str, InFlight] = {}
    into: set[str] = set()  # sent to an aggregator (a member, or an aggregate into its parent)
    for _ in range(steps):
        now += rng.uniform(0.0, 0.004)
        for w, host in WORKERS.items():
            if rng.random() < 0.3:
                seq[w] += 1
                if w != "w3" and rng.random() < 0.15:
                    version[w] += 1  # a get() of a newer model
                uid = f"{host}/{seq[w]}"
                pending[uid] = PendingUpdate(uid, "j", "s", w, host, "ps", 150, 1.0, version[w], now)
        snap = Snapshot(
            now, g, tuple(flying.values()), rounds={("j", "s"): spec}, aggregators=frozenset({"ax", "bx"})
        )
        decision = runner.decide(snap, list(pending.values()))
        for d in decision.drops:
            pending.pop(d.update_id, None)
        twice = {m: aids for m, aids in memberships(runner).items() if len(aids) > 1}
        assert not twice, f"seed {seed} at {now:.3f}: members of two aggregates: {twice}"
        for uid in [u for u, f in flying.items() if f.expected_end <= now]:  # transfers done
            del flying[uid]
            if uid in into:
                runner.arrived(uid)
        if rng.random() < 0.5:  # the service releases between decisions, not after each one
            continue
        released = runner.release(now, flying)
        for r in released.sends:
            uid = r.send.update_id
            pending.pop(uid, None)
            of = runner.aggregate_of(uid)
            if r.send.next_hop == "ps":
                assert of is None, f"seed {seed}: {uid} sent to the server, yet a member of {of}"
            else:
                assert of is not None, f"seed {seed}: {uid} sent to {r.send.next_hop}, a member of nothing"
                assert of.aggregator == r.send.next_hop, f"seed {seed}: {uid} sent away from {of}"
                into.add(uid)
            end = max(now, r.expected_end) + rng.uniform(0.0, 0.02)
            flying[uid] = InFlight(uid, "j", "s", r.send.path, 150, now, end)
        for a in released.aggregates:
            forwarded += 1
            if runner.aggregate_of(a.aggregate_id) is not None:  # summed into a parent aggregate
                into.add(a.aggregate_id)
            flying[a.aggregate_id] = InFlight(
                a.aggregate_id, "j", "s", a.path, 150, now, now + rng.uniform(0, 0.01)
            )
        runner.moved(len(pending))
    return forwarded


@pytest.mark.parametrize("seed", range(4))
def test_an_update_is_a_member_of_one_aggregate_at_a_time(seed: int) -> None:
    assert drive(seed) > 0  # trees formed


def test_a_round_does_not_claim_an_update_already_in_an_aggregate() -> None:
    """The ``sync-rounds`` stall: w3's 29th update, computed from version 0 like its 28 before,
    was in an aggregate at ``ax`` (with w1's update of version 1, already sent) when a round
    of version 0 was planned anew with it as its first member: the round sent it to ``bx``,
    and the aggregate at ``ax`` waited for it until its aggregator's timeout. The round book
    leaves such an update to the policy's other path, which keeps it in its aggregate."""
    policy = make_policy("stf+tree", sync=True).policy
    assert isinstance(policy, TreePolicy)
    g = racks()
    paths = PathCache(g)
    late = PendingUpdate("b1/29", "j", "s", "w3", "b1", "ps", 150, 1.0, 0, 0.0)
    there = PlannedAggregate("agg:s:14", "ax", ("a1/5", late.update_id), 150, "ps")
    snap = Snapshot(
        0.0,
        g,
        rounds={("j", "s"): RoundSpec(WORKERS)},
        aggregators=frozenset({"ax", "bx"}),
        gathering=(there,),
    )
    sends, aggregates, rest = policy.rounds.decide(
        snap, [late], paths, lambda s, ups: policy._plan_round(s, ups, paths)
    )
    assert [p.update_id for p in rest] == [late.update_id]
    assert not [s for s in sends if s.update_id == late.update_id]
    assert not [a for a in aggregates if late.update_id in a.members]
