"""Aggregation groups over the STF order (paper §5, Fig. 6) pass the checker."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.scheduler.core.checker import check_schedule
from mlfabric.scheduler.core.graph import star, two_tier
from mlfabric.scheduler.core.schedule import Schedule, Update
from mlfabric.scheduler.policies.aggregation import plan_aggregation, plan_aggregation_sync
from mlfabric.scheduler.policies.stf import plan_stf

MB = 1e6


def ingress_payloads(s: Schedule, host: str) -> int:
    return sum(1 for t in s.transfers if t.dst == host and not t.replica)


def test_fig6_groups_and_the_update_left_out() -> None:
    # server link 1 MB/s; workers 4 MB/s except w5 (0.5 MB/s): u5 cannot reach the
    # aggregator while u0 is on the server's link, like u6 in Fig. 6
    names = ["ps", "x", *[f"w{i}" for i in range(6)]]
    nic = {h: 32e6 for h in names} | {"ps": 8e6, "w5": 4e6}
    g = star(names, nic)
    us = [Update(f"u{i}", f"w{i}", "ps", 1 * MB) for i in range(6)]
    plan = plan_aggregation(g, us, aggregators=["x"])
    check_schedule(g, plan, updates=us)
    first = plan.aggregates[0]
    assert (first.aggregator, first.members) == ("x", ("u1", "u2", "u3", "u4"))
    assert "u5" not in plan.aggregates[0].members
    assert ingress_payloads(plan, "ps") < len(us)
    stf = plan_stf(g, us)
    assert plan.makespan() < stf.makespan()


def test_aggregator_is_off_the_servers_bottleneck() -> None:
    # rack uplinks at half a NIC (oversubscription 8): workers in rack 1 gather in rack 1
    g = two_tier(2, 4, 8 * MB, oversubscription=8.0)
    us = [Update(f"u{i}", f"h{i}", "h0", 1 * MB) for i in (4, 5, 6)]
    plan = plan_aggregation(g, us, aggregators=["h1", "h2", "h7"])
    check_schedule(g, plan, updates=us)
    assert [a.aggregator for a in plan.aggregates] == ["h7"]


def test_several_servers_share_the_timelines() -> None:
    names = ["ps0", "ps1", "x", "y", *[f"w{i}" for i in range(6)]]
    g = star(names, {h: (8e6 if h.startswith("ps") else 32e6) for h in names})
    us = [Update(f"u{i}", f"w{i}", f"ps{i % 2}", 1 * MB) for i in range(6)] + [
        Update(f"v{i}", f"w{i}", f"ps{(i + 1) % 2}", 1 * MB) for i in range(6)
    ]
    plan = plan_aggregation(g, us, aggregators=["x", "y"])
    check_schedule(g, plan, updates=us)
    assert {a.dst for a in plan.aggregates} == {"ps0", "ps1"}


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from([4e6, 8e6, 32e6, 64e6]), min_size=2, max_size=7),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 3),
)
def test_sync_plan_is_valid_and_never_slower_than_stf(nics: list[float], size_mb: int, n_agg: int) -> None:
    workers = [f"w{i}" for i in range(len(nics))]
    aggs = [f"a{i}" for i in range(n_agg)]
    g = star(
        ["ps", *workers, *aggs],
        {"ps": 8e6, **dict(zip(workers, nics, strict=True)), **dict.fromkeys(aggs, 64e6)},
    )
    us = [Update(f"u{i}", w, "ps", size_mb * MB) for i, w in enumerate(workers)]
    plan = plan_aggregation_sync(g, us, aggregators=aggs + workers)
    check_schedule(g, plan, updates=us)
    assert plan.makespan() <= plan_stf(g, us).makespan() + 1e-9
    async_plan = plan_aggregation(g, us, aggregators=aggs)
    check_schedule(g, async_plan, updates=us)
