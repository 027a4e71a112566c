"""stf+agg: aggregators that feed the server's ingress at its rate, and joins that never idle it.

Both rules come from the namespace testbed (docs/aggregation-service.md): aggregates were
forwarded over slow workers' own uplinks (1.4 MB/s into a 12.5 MB/s ingress), and the ingress
idled while open aggregates waited for joiners later than estimated.
"""

from __future__ import annotations

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.graph import PathCache, star
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.policies.aggregation import AggregationPolicy, plan_aggregation
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, PlannedAggregate, Snapshot
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.joining import join_open
from mlfabric.scheduler.policies.runner import DecisionRunner

MB = 10**6
#: the testbed's shape, scaled: ingress 1 MB/s; uplinks 4, 4, 2, 2, 1, 1, 0.5, 0.5 MB/s
UPLINKS = [32e6, 32e6, 16e6, 16e6, 8e6, 8e6, 4e6, 4e6]
WORKERS = [f"w{i}" for i in range(len(UPLINKS))]


def _testbed_star() -> nx.DiGraph:
    return star(["ps", *WORKERS], {"ps": 8e6, **dict(zip(WORKERS, UPLINKS, strict=True))})


def _p(worker: str, ready: float = 0.0, uid: str | None = None) -> PendingUpdate:
    return PendingUpdate(uid or f"u-{worker}", "j", "s", worker, worker, "ps", MB, 1.0, 0, ready)


def _busy_until(t: float) -> InFlight:
    """A transfer from w0 holding ps's ingress until ``t``."""
    return InFlight("busy", "j", "s", ("w0", "sw", "ps"), int(t * MB), 0.0, t)


def test_a_slow_workers_update_is_gathered_at_a_host_that_feeds_the_ingress_at_its_rate() -> None:
    # w7's uplink (0.5 MB/s) is half the ingress: gathered at w7 itself, the aggregate (and
    # every joiner's bytes) would cross it at 0.5 MB/s; at w0 it leaves at the ingress's rate
    g = _testbed_star()
    policy = AggregationPolicy(sync=False, aggregators=WORKERS)
    d = policy.decide(Snapshot(0.0, g, in_flight=(_busy_until(4.0),)), [_p("w7")])
    (agg,) = d.aggregates
    assert agg.aggregator not in {"w4", "w5", "w6", "w7"}
    assert [(s.update_id, s.next_hop) for s in d.sends] == [("u-w7", agg.aggregator)]


def test_a_fast_workers_update_is_still_gathered_at_its_own_host() -> None:
    g = _testbed_star()
    policy = AggregationPolicy(sync=False, aggregators=WORKERS)
    d = policy.decide(Snapshot(0.0, g, in_flight=(_busy_until(4.0),)), [_p("w1")])
    assert [a.aggregator for a in d.aggregates] == ["w1"]


def test_slow_aggregators_are_used_when_no_other_can_aggregate() -> None:
    g = _testbed_star()
    policy = AggregationPolicy(sync=False, aggregators=["w6", "w7"])
    d = policy.decide(Snapshot(0.0, g, in_flight=(_busy_until(4.0),)), [_p("w7")])
    assert [a.aggregator for a in d.aggregates] == ["w7"]


def test_a_slow_update_is_gathered_for_others_to_join_even_while_the_ingress_is_idle() -> None:
    # ps is idle. w7's update (0.5 MB/s) would hold the ingress for 2 s at half its rate; it is
    # gathered at a host that feeds the ingress, and w1's update, ready at 1.2 and there by
    # 1.45 (before w7's would be in at ps directly), is summed with it: one payload for both
    g = _testbed_star()
    plan = plan_aggregation(
        g,
        [Update("u7", "w7", "ps", MB), Update("u1", "w1", "ps", MB, ready_at=1.2)],
        aggregators=WORKERS,
        min_members=1,
    )
    check_schedule(
        g, plan, updates=[Update("u7", "w7", "ps", MB), Update("u1", "w1", "ps", MB, ready_at=1.2)]
    )
    (agg,) = plan.aggregates
    assert set(agg.members) == {"u7", "u1"} and agg.aggregator in {"w0", "w1", "w2", "w3"}
    assert [t.payload_id for t in plan.transfers if t.dst == "ps"] == [agg.aggregate_id]
    # the offline planner (at least two members, Fig. 6) still sends the first update directly
    offline = plan_aggregation(g, [Update("u7", "w7", "ps", MB)], aggregators=WORKERS)
    assert not offline.aggregates


@settings(max_examples=30, deadline=None)
@given(
    ready=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=8),
    busy_for=st.floats(0.0, 3.0),
)
def test_plans_on_the_heterogeneous_star_pass_the_checker(ready: list[float], busy_for: float) -> None:
    g = _testbed_star()
    us = [Update(f"u{i}", WORKERS[i], "ps", MB, ready_at=r) for i, r in enumerate(ready)]
    plan = plan_aggregation(g, us, aggregators=WORKERS, ahead_until={"ps": busy_for}, min_members=1)
    check_schedule(g, plan, updates=us)
    summed = [m for a in plan.aggregates for m in a.members]
    assert len(summed) == len(set(summed))
    pc = PathCache(g)
    for a in plan.aggregates:  # every aggregate's path into ps is as wide as the ingress
        assert min(g.edges[link]["capacity"] for link in pc.links(a.aggregator, "ps")) >= 1e6


# -- joins are work-conserving --------------------------------------------------------------

HOSTS = ["ps", "w1", "w2", "x", "y"]


def _agg(aid: str, at: str, members: tuple[str, ...]) -> PlannedAggregate:
    return PlannedAggregate(aid, at, members, float(MB), "ps", ())


def _member(uid: str, src: str, at: str, end: float) -> InFlight:
    return InFlight(uid, "j", "s", (src, "sw", at), MB, 0.0, end)


def test_a_joiner_does_not_hold_the_aggregate_while_the_ingress_is_idle() -> None:
    # ps is idle; agg's member is in at x at 1.3; u2 (1 MB/s) would be in at 2.05, within one
    # update's time (1 s) on the ingress but 0.75 s after agg could leave: it does not join
    g = star(HOSTS, {"ps": 8e6, "w1": 32e6, "w2": 8e6, "x": 32e6, "y": 32e6})
    snap = Snapshot(1.05, g, in_flight=(_member("u1", "w1", "x", 1.3),), gathering=(_agg("a", "x", ("u1",)),))
    u2 = PendingUpdate("u2", "j", "s", "w2", "w2", "ps", MB, 1.0, 0, 1.05)
    assert join_open(snap, [u2], {"a": "j/s"}, PathCache(g)) == ([], {})
    # one update's slack (the rule before) lets it join
    _, joined = join_open(snap, [u2], {"a": "j/s"}, PathCache(g), slack=1.0)
    assert joined["a"].members == ("u1", "u2")
    # and the policy's default is this rule
    assert AggregationPolicy(sync=False).join_slack == 0.25


def test_a_joiner_that_arrives_while_the_ingress_is_busy_joins() -> None:
    g = star(HOSTS, {"ps": 8e6, "w1": 32e6, "w2": 16e6, "x": 32e6, "y": 32e6})
    busy = InFlight("busy", "j", "s", ("y", "sw", "ps"), 2 * MB, 0.0, 2.0)
    snap = Snapshot(
        1.05, g, in_flight=(busy, _member("u1", "w1", "x", 1.3)), gathering=(_agg("a", "x", ("u1",)),)
    )
    u2 = PendingUpdate("u2", "j", "s", "w2", "w2", "ps", MB, 1.0, 0, 1.05)
    sends, joined = join_open(snap, [u2], {"a": "j/s"}, PathCache(g))
    assert [(s.update_id, s.next_hop) for s in sends] == [("u2", "x")]
    assert joined["a"].members == ("u1", "u2")


def test_the_ingress_is_busy_with_the_forwards_of_the_aggregates_opened_earlier() -> None:
    # ps is idle; a (at x) may leave now and then takes the ingress 1 s; b (at y) leaves after
    # it. u2 reaches either aggregator at 0.5: too late for a, in time for b
    g = star(HOSTS, {"ps": 8e6, "w1": 32e6, "w2": 16e6, "x": 32e6, "y": 32e6})
    gathering = (_agg("a", "x", ("u0",)), _agg("b", "y", ("u1",)))
    snap = Snapshot(0.0, g, gathering=gathering)
    u2 = PendingUpdate("u2", "j", "s", "w2", "w2", "ps", MB, 1.0, 0, 0.0)
    sends, joined = join_open(snap, [u2], {"a": "j/s", "b": "j/s"}, PathCache(g))
    assert [(s.update_id, s.next_hop) for s in sends] == [("u2", "y")]
    assert list(joined) == ["b"] and joined["b"].members == ("u1", "u2")


def test_every_member_is_released_once_through_the_runner_with_fast_aggregators() -> None:
    # the decision pipeline the service runs: updates trickle in while ps is busy; each is
    # sent exactly once (directly or to one aggregate), and aggregates sit on fast hosts
    g = _testbed_star()
    r = DecisionRunner(AggregationPolicy(sync=False, aggregators=WORKERS), dispatcher=Dispatcher(margin=0.0))
    flying: dict[str, InFlight] = {"busy": _busy_until(2.0)}
    pending: dict[str, PendingUpdate] = {}
    sent: list[str] = []
    for i, w in enumerate([*reversed(WORKERS), None, None, None]):
        now = 0.1 * i if w is not None else 2.0 * i
        if w is not None:
            pending[f"u-{w}"] = _p(w, now)
        r.decide(Snapshot(now, g, in_flight=tuple(flying.values())), list(pending.values()))
        for x in r.release(now, flying).sends:
            sent.append(x.send.update_id)
            del pending[x.send.update_id]
            flying[x.send.update_id] = InFlight(
                x.send.update_id, "j", "s", x.send.path, MB, now, x.expected_end
            )
        if w is None:  # later: everything sent is in
            flying.clear()
    assert sorted(sent) == sorted(f"u-{w}" for w in WORKERS)
    members = [m for a in r.gathering for m in a.members]
    assert len(members) == len(set(members))
    assert r.gathering and all(a.aggregator in {"w0", "w1", "w2", "w3"} for a in r.gathering)
