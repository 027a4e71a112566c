"""stf+agg online: later arrivals join an aggregate being gathered (scheduler/policies/joining.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.policies.aggregation import AggregationPolicy, plan_aggregation
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.runner import DecisionRunner

HOSTS = ["ps", "w0", "w1", "w2", "w3", "x"]


def _graph(worker_rate: float = 32e6) -> object:
    return star(HOSTS, {"ps": 8e6, **{h: worker_rate for h in HOSTS[1:]}})


def _p(i: int, ready: float = 0.0, server: str = "s", job: str = "j") -> PendingUpdate:
    return PendingUpdate(f"u{i}", job, server, f"w{i}", f"w{i}", "ps", 10**6, 1.0, 0, ready)


def _runner(join: bool = True) -> DecisionRunner:
    policy = AggregationPolicy(sync=False, aggregators=["x"], join=join)
    return DecisionRunner(policy, dispatcher=Dispatcher(margin=0.0))


def _in_flight(runner: DecisionRunner, released: list, now: float) -> dict[str, InFlight]:
    return {
        r.send.update_id: InFlight(r.send.update_id, "j", "s", r.send.path, 10**6, now, r.expected_end)
        for r in released
    }


def test_lone_update_while_the_server_is_busy_opens_an_aggregate_the_next_one_joins() -> None:
    r = _runner()
    g = _graph()
    r.decide(Snapshot(0.0, g), [_p(0), _p(1)])
    first = r.release(0.0, {}).sends
    assert {(x.send.update_id, x.send.next_hop) for x in first} == {("u0", "ps"), ("u1", "x")}
    (agg,) = r.gathering
    assert agg.members == ("u1",)
    flying = _in_flight(r, list(first), 0.0)
    # u2 becomes ready while u0 is on the server's link (1 s): it joins the open aggregate
    d = r.decide(Snapshot(0.1, g, in_flight=tuple(flying.values())), [_p(2, 0.1)])
    assert [(s.update_id, s.next_hop) for s in d.sends] == [("u2", "x")]
    assert [(a.aggregate_id, a.members) for a in d.aggregates] == [(agg.aggregate_id, ("u1", "u2"))]
    assert [a.members for a in r.gathering] == [("u1", "u2")]
    assert r.aggregate_of("u2") is not None
    # the aggregate waits for its new member
    r.arrived("u1")
    assert not r.release(1.5, {}).aggregates
    r.arrived("u2")
    (out,) = r.release(1.5, {}).aggregates
    assert out.members == ("u1", "u2")


def test_without_join_the_lone_update_goes_directly() -> None:
    r = _runner(join=False)
    g = _graph()
    r.decide(Snapshot(0.0, g), [_p(0)])
    first = r.release(0.0, {}).sends
    flying = _in_flight(r, list(first), 0.0)
    d = r.decide(Snapshot(0.1, g, in_flight=tuple(flying.values())), [_p(1, 0.1)])
    assert [(s.update_id, s.next_hop) for s in d.sends] == [("u1", "ps")]
    assert not d.aggregates


def test_update_that_cannot_reach_the_aggregator_in_time_does_not_join() -> None:
    # w3's uplink is slow: 1 MB takes 4 s to reach x, the server's ingress frees at 1 s and
    # one update takes 1 s on it, so joining would hold the aggregate back: u3 does not join it
    # (its uplink is narrower than the ingress, so it is gathered on its own, or goes directly)
    g = star(HOSTS, {"ps": 8e6, "w0": 32e6, "w1": 32e6, "w2": 32e6, "w3": 2e6, "x": 32e6})
    r = _runner()
    r.decide(Snapshot(0.0, g), [_p(0), _p(1)])
    first = r.release(0.0, {}).sends
    flying = _in_flight(r, list(first), 0.0)
    d = r.decide(Snapshot(0.1, g, in_flight=tuple(flying.values())), [_p(3, 0.1)])
    assert not any("u1" in a.members and "u3" in a.members for a in d.aggregates)
    assert ("u1",) in [a.members for a in r.gathering]


def test_update_of_another_server_never_joins() -> None:
    r = _runner()
    g = _graph()
    r.decide(Snapshot(0.0, g), [_p(0), _p(1)])
    first = r.release(0.0, {}).sends
    flying = _in_flight(r, list(first), 0.0)
    d = r.decide(Snapshot(0.1, g, in_flight=tuple(flying.values())), [_p(2, 0.1, server="other")])
    assert all(u != "u2" for a in d.aggregates for u in a.members if a.members[0] == "u1")
    assert [a.members for a in r.gathering if "u1" in a.members] == [("u1",)]


def test_stale_update_is_dropped_not_joined() -> None:
    r = _runner()
    g = _graph()
    r.decide(Snapshot(0.0, g, tau_max={"j": 2}, server_versions={("j", "s"): 0}), [_p(0), _p(1)])
    first = r.release(0.0, {}).sends
    flying = _in_flight(r, list(first), 0.0)
    snap = Snapshot(
        0.1, g, in_flight=tuple(flying.values()), tau_max={"j": 2}, server_versions={("j", "s"): 5}
    )
    d = r.decide(snap, [_p(2, 0.1)])
    assert [x.update_id for x in d.drops] == ["u2"] and not d.sends
    assert [a.members for a in r.gathering] == [("u1",)]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from([4e6, 8e6, 32e6, 64e6]), min_size=1, max_size=6),
    st.floats(min_value=0.0, max_value=3.0),
)
def test_online_plans_with_lone_groups_pass_the_checker(nics: list[float], busy_for: float) -> None:
    names = ["ps", "x", "y", *[f"w{i}" for i in range(len(nics))]]
    g = star(names, {"ps": 8e6, "x": 32e6, "y": 32e6, **{f"w{i}": n for i, n in enumerate(nics)}})
    us = [Update(f"u{i}", f"w{i}", "ps", 1e6) for i in range(len(nics))]
    plan = plan_aggregation(g, us, aggregators=["x", "y"], ahead_until={"ps": busy_for}, min_members=1)
    check_schedule(g, plan, updates=us)
    summed = [m for a in plan.aggregates for m in a.members]
    assert len(summed) == len(set(summed))
    if busy_for > 0 and len(us) == 1:  # a lone update while the server is busy is gathered
        assert [a.members for a in plan.aggregates] in ([("u0",)], [])
