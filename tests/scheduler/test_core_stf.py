"""STF ordering, tau_max drops and the stf policy (paper §3.1.1, §5 Fig. 4 and Fig. 5)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import networkx as nx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.graph import PathCache, star, two_tier
from mlfabric.scheduler.core.schedule import Schedule, Update
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.stf import STFPolicy, plan_stf, server_key

MB = 1e6


def naive_stf(
    graph: nx.DiGraph, updates: Sequence[Update], tls: Timelines | None = None
) -> list[tuple[str, float]]:
    """Textbook STF: every round recompute ten for every candidate (no heap, no classes).

    Ties break on (ten, bytes, ready time, id), as documented for :func:`plan_stf`.
    """
    tls = tls if tls is not None else Timelines(graph)
    pc = PathCache(graph)
    left = list(updates)
    out = []
    while left:
        best = min(
            left,
            key=lambda u: (
                tls.ten(pc.links(u.src, u.dst), u.bytes, u.ready_at)[1],
                u.bytes,
                u.ready_at,
                u.update_id,
            ),
        )
        _, end, _ = tls.reserve(pc.links(best.src, best.dst), best.bytes, best.ready_at)
        out.append((best.update_id, end))
        left.remove(best)
    return out


def assert_same_order(plan: Schedule, expected: list[tuple[str, float]]) -> None:
    """The plan's order is the textbook's, but for transfers whose ``ten`` tie to the last bits.

    The two compute a ``ten`` over differently split residual pieces, so a tie can round
    either way (17.666666666666668 against 17.666666666666664): either order is then STF.
    """
    ends = plan.completion_times()
    got = [(uid, ends[uid]) for uid in plan.arrivals]
    assert [e for _, e in got] == pytest.approx([e for _, e in expected], rel=1e-12)
    for (a, ea), (b, eb) in zip(got, expected, strict=True):
        assert a == b or ea == pytest.approx(eb, rel=1e-12), (got, expected)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=7))
def test_stf_is_optimal_on_one_bottleneck(sizes: list[int]) -> None:
    # workers' NICs are 4x the server's: the server's ingress is the one bottleneck
    names = ["ps"] + [f"w{i}" for i in range(len(sizes))]
    g = star(names, {n: (8.0 if n == "ps" else 32.0) for n in names})
    updates = [Update(f"u{i}", f"w{i}", "ps", float(b)) for i, b in enumerate(sizes)]
    plan = plan_stf(g, updates)
    check_schedule(g, plan, updates=updates)
    stf_mean = sum(plan.completion_times().values()) / len(sizes)
    best = min(sum(itertools.accumulate(order)) for order in itertools.permutations(sizes)) / len(sizes)
    assert stf_mean == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 1), st.integers(1, 9), st.integers(0, 3)),
        min_size=1,
        max_size=10,
    )
)
def test_lazy_heap_matches_textbook_stf(spec: list[tuple[int, int, int, int]]) -> None:
    # heterogeneous NICs, two servers, several updates per host, staggered ready times
    names = ["ps0", "ps1"] + [f"w{i}" for i in range(6)]
    g = star(names, {n: 8.0 * (1 + i % 3) for i, n in enumerate(names)})
    updates = [
        Update(f"u{k}", f"w{w}", f"ps{s}", float(b), ready_at=float(r)) for k, (w, s, b, r) in enumerate(spec)
    ]
    plan = plan_stf(g, updates)
    check_schedule(g, plan, updates=updates)
    assert_same_order(plan, naive_stf(g, updates))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([8.0, 24.0, 80.0]), min_size=8, max_size=8),
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1), st.integers(1, 30)), min_size=1, max_size=14),
    st.lists(st.tuples(st.integers(0, 7), st.integers(1, 6)), max_size=3),
)
@example(  # u1 and u2 tie to the last bits (ends 17.666666666666668 / ...664): either order
    nics=[24.0, 8.0, 8.0, 8.0, 8.0, 24.0, 8.0, 8.0],
    spec=[(0, 1, 5), (1, 0, 14), (1, 1, 16), (2, 1, 7), (5, 0, 11)],
    busy=[],
)
def test_lazy_heap_matches_textbook_stf_on_two_tier_with_transfers_in_flight(
    nics: list[float], spec: list[tuple[int, int, int]], busy: list[tuple[int, int]]
) -> None:
    # 2 racks x 4 hosts, heterogeneous NICs, uplinks 2:1 oversubscribed, servers h0 and h5
    g = two_tier(2, 4, {f"h{i}": nic for i, nic in enumerate(nics)}, oversubscription=2.0)
    pc = PathCache(g)
    base = Timelines(g)
    for host, until in busy:  # transfers in flight from some hosts to h0 keep their paths
        base.reserve_until(pc.links(f"h{host}", "h0"), 0.0, float(until))
    servers = ("h0", "h5")
    updates = [Update(f"u{k}", f"h{w}", servers[s], float(b)) for k, (w, s, b) in enumerate(spec)]
    plan = plan_stf(g, updates, timelines=base.copy(), paths=pc)
    assert_same_order(plan, naive_stf(g, updates, base.copy()))


def test_several_bottlenecks_two_tier() -> None:
    # 2 racks of 3 hosts, uplinks oversubscribed 3:1 (uplink = one NIC); servers in each rack
    g = two_tier(2, 3, 8 * MB, oversubscription=3.0)
    updates = [
        Update("a", "h1", "h0", 2 * MB),  # in rack to ps h0
        Update("b", "h4", "h0", 1 * MB),  # across the uplink to h0
        Update("c", "h5", "h3", 1 * MB),  # in rack 1 to ps h3
        Update("d", "h2", "h3", 3 * MB),  # across the other uplink to h3
    ]
    plan = plan_stf(g, updates)
    check_schedule(g, plan, updates=updates)
    ends = plan.completion_times()
    assert ends == pytest.approx({"b": 1.0, "c": 1.0, "a": 3.0, "d": 4.0})  # c shares nothing with b


def test_tau_max_drops_with_numbers_and_reorders_the_rest() -> None:
    g = star(["ps", "w1", "w2", "w3"], 8.0)
    updates = [
        Update("fresh", "w1", "ps", 1.0, base_version=10),
        Update("old", "w2", "ps", 2.0, base_version=7),
        Update("ok", "w3", "ps", 3.0, base_version=9),
    ]
    plan = plan_stf(g, updates, tau_max=2, server_version=10)
    check_schedule(g, plan, updates=updates, tau_max=2, server_version=10)
    assert plan.drops == {
        "old": "expected delay 4 > tau_max 2 (server version 10 - base_version 7 + 1 ordered ahead)"
    }
    assert plan.arrivals == ("fresh", "ok")
    assert plan.completion_times()["ok"] == pytest.approx(4.0)  # right after "fresh": old's slot is reused
    unbounded = plan_stf(g, updates, server_version=10)
    assert unbounded.arrivals == ("fresh", "old", "ok") and not unbounded.drops


def pending(uid: str, host: str, size: float, base: int = 0, server: str = "ps") -> PendingUpdate:
    return PendingUpdate(uid, "j", server, host, host, "ps", int(size), 1.0, base, 0.0)


def test_policy_follows_in_flight_and_counts_it_ahead() -> None:
    g = star(["ps", "a", "b", "c"], 8.0)
    snap = Snapshot(
        now=10.0,
        graph=g,
        in_flight=(InFlight("x", "j", "ps", ("c", "sw", "ps"), 4, started_at=9.0, expected_end=12.0),),
        server_versions={("j", "ps"): 5},
        tau_max={"j": 1},
    )
    policy = make_policy("stf").policy
    assert isinstance(policy, STFPolicy)
    d = policy.decide(
        snap, [pending("u1", "a", 2, base=5), pending("u2", "b", 1, base=4), pending("u3", "b", 3, base=5)]
    )
    assert [(s.update_id, s.after, s.expected_start, s.expected_end) for s in d.sends] == [
        ("u1", ("x",), 12.0, 14.0)
    ]
    assert [(x.update_id, x.reason) for x in d.drops] == [
        ("u2", "expected delay 2 > tau_max 1 (server version 5 - base_version 4 + 1 ordered ahead)"),
        ("u3", "expected delay 2 > tau_max 1 (server version 5 - base_version 5 + 2 ordered ahead)"),
    ]
    assert policy.decide(snap, [pending("u1", "a", 2, base=5)]) == policy.decide(
        snap, [pending("u1", "a", 2, base=5)]
    )


def test_policy_chains_sends_on_the_bottleneck() -> None:
    g = star(["ps", "a", "b", "c"], 8.0)
    d = STFPolicy().decide(
        Snapshot(now=0.0, graph=g), [pending("p", "a", 3), pending("q", "b", 1), pending("r", "c", 2)]
    )
    assert [(s.update_id, s.after, s.expected_end) for s in d.sends] == [
        ("q", (), 1.0),
        ("r", ("q",), 3.0),
        ("p", ("r",), 6.0),
    ]
    assert d.sends[0].path == ("b", "sw", "ps") and d.sends[0].next_hop == "ps"


def test_unknown_host_is_dropped_with_reason() -> None:
    g = star(["ps", "a"], 8.0)
    plan = plan_stf(g, [Update("u", "nowhere", "ps", 1.0)])
    assert plan.drops["u"].startswith("no route:") and "nowhere" in plan.drops["u"]
    assert server_key("j", "s") == "j/s"


def test_limit_and_horizon_give_the_head_of_the_full_order() -> None:
    g = star(["ps", *[f"w{i}" for i in range(8)]], 8.0)
    updates = [Update(f"u{i}", f"w{i}", "ps", float(9 - i), base_version=0) for i in range(8)]
    full = plan_stf(g, updates, tau_max=5)
    head = plan_stf(g, updates, tau_max=5, limit=3)
    assert head.transfers == full.transfers[:3] and not head.drops and len(full.drops) == 2
    pend = [pending(u.update_id, u.src, u.bytes) for u in updates]
    d = STFPolicy(horizon=2).decide(Snapshot(now=0.0, graph=g), pend)
    assert [s.update_id for s in d.sends] == ["u7", "u6"]
    with pytest.raises(ValueError, match="horizon"):
        STFPolicy(horizon=0)


def test_equal_transfers_go_first_come_first_served() -> None:
    """Ties in ten break on ready time before id, so no worker's ids starve it."""
    from mlfabric.scheduler.core.graph import star
    from mlfabric.scheduler.core.schedule import Update
    from mlfabric.scheduler.policies.stf import plan_stf

    g = star(["ps", "a", "z"], 8e6)
    # z's update is ready first; a's id sorts first; with ten equal, z must go first.
    updates = [Update("z/1", "z", "ps", 1e6, 0.0), Update("a/1", "a", "ps", 1e6, 0.5)]
    plan = plan_stf(g, updates, now=1.0)
    assert plan.arrivals == ("z/1", "a/1")
    # Same ready time: the id decides, deterministically.
    plan = plan_stf(g, [Update("z/2", "z", "ps", 1e6, 0.0), Update("a/2", "a", "ps", 1e6, 0.0)])
    assert plan.arrivals == ("a/2", "z/2")
