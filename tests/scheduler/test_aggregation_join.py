"""stf+agg online: later arrivals join an aggregate being gathered (scheduler/policies/joining.py)."""

from __future__ import annotations

from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.aggregation import AggregationPolicy
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
    # one update takes 1 s on it, so joining would hold the aggregate back: u3 goes directly
    g = star(HOSTS, {"ps": 8e6, "w0": 32e6, "w1": 32e6, "w2": 32e6, "w3": 2e6, "x": 32e6})
    r = _runner()
    r.decide(Snapshot(0.0, g), [_p(0), _p(1)])
    first = r.release(0.0, {}).sends
    flying = _in_flight(r, list(first), 0.0)
    d = r.decide(Snapshot(0.1, g, in_flight=tuple(flying.values())), [_p(3, 0.1)])
    assert all(s.next_hop == "ps" for s in d.sends if s.update_id == "u3")
    assert [a.members for a in r.gathering] == [("u1",)]


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
