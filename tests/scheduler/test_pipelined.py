"""Pipelined aggregation trees for synchronous rounds (scheduler/policies/pipelined.py).

Small graphs whose optimum is computed by hand: on equal NICs a chain through the workers
into the server loads every NIC direction with one update (one update's time plus a chunk per
hop), where pairs summed at two hosts put two payloads into the server's link; across two
racks behind uplinks no faster than a NIC, a chain through both racks crosses each uplink
direction once.
"""

from __future__ import annotations

import math
import random

import networkx as nx
import pytest

from mlfabric.scheduler.core.checker import ScheduleError, check_schedule
from mlfabric.scheduler.core.graph import PathCache, star, two_tier
from mlfabric.scheduler.core.schedule import Aggregate, Schedule, Transfer, Update
from mlfabric.scheduler.policies.allreduce_model import tree_terms, tree_time
from mlfabric.scheduler.policies.base import Snapshot
from mlfabric.scheduler.policies.pipelined import pipelined_schedule, plan_pipelined_round
from mlfabric.scheduler.policies.registry import make_policy
from mlfabric.scheduler.policies.tree_policy import TreePolicy

MB = 1_000_000


def racks(per_rack: int = 2, nic: float = 8e6) -> tuple[nx.DiGraph, list[Update]]:
    """Two racks of ``per_rack`` hosts, uplinks at one NIC's rate, the server ``ps`` on the core."""
    g = two_tier(2, per_rack, nic, oversubscription=per_rack)
    g.add_node("ps", kind="host")
    g.add_edge("ps", "core", capacity=nic / 8)
    g.add_edge("core", "ps", capacity=nic / 8)
    return g, [Update(f"u{i}", f"h{i}", "ps", MB) for i in range(2 * per_rack)]


def link_payloads(tree: object, g: object, server: str) -> dict[tuple[str, str], int]:
    """Payloads crossing each directed link (one per tree edge)."""
    pc = PathCache(g)
    out: dict[tuple[str, str], int] = {}
    for h, p in tree.parent.items():  # type: ignore[attr-defined]
        for link in pc.links(h, p):
            out[link] = out.get(link, 0) + 1
    return out


def test_chain_beats_pairs_under_pipelining() -> None:
    # 4 workers + the server on one switch, 1 MB/s NICs, 1 MB updates: store-and-forward needs
    # ceil(log2(5)) = 3 s; pairs (a+b, c+d) pipelined put 2 MB through the server's link (2 s);
    # a chain puts 1 MB through every NIC direction (1 s + a chunk per hop)
    g = star(["ps", "a", "b", "c", "d"], 8e6)
    ups = [Update(f"u{h}", h, "ps", MB) for h in "abcd"]
    chunk = 50_000
    t = plan_pipelined_round(g, ups, chunk_bytes=chunk)
    assert t.busiest == pytest.approx(1.0)
    assert max(link_payloads(t, g, "ps").values()) == 1
    assert sorted(t.parent.values()).count("ps") == 1  # one payload into the server
    pc = PathCache(g)
    hosts = {h: h for h in "abcd"} | {"S": "ps"}
    pairs = {"S": None, "b": "S", "d": "S", "a": "b", "c": "d"}
    pairs_terms = tree_terms(g, pairs, hosts, MB, pc, reduce_only=True)
    assert pairs_terms[0] == pytest.approx(2.0)  # the server's link carries two payloads
    assert t.seconds < tree_time(pairs_terms, MB, chunk, reduce_only=True)
    # the model: 1 s + 4 hops of a 50 kB chunk at 1 MB/s (each hop's link alone) + frame costs
    assert t.seconds == pytest.approx(1.0 + 4 * 0.05 + 20 * 2 * 700e-6)
    assert t.seconds < 3.0


def test_two_racks_each_uplink_direction_crossed_once() -> None:
    g, ups = racks(per_rack=4)
    t = plan_pipelined_round(g, ups)
    loads = link_payloads(t, g, "ps")
    assert max(loads.values()) == 1  # every link direction carries one payload
    assert loads[("core", "ps")] == 1
    assert t.busiest == pytest.approx(1.0)
    # store-and-forward's optimum for 8 leaves + a summing server: 4 update times
    assert t.seconds < 0.5 * math.ceil(math.log2(9))


@pytest.mark.parametrize("seed", range(5))
def test_two_racks_with_uneven_estimates_still_get_one_chain(seed: int) -> None:
    """Estimated rates a few percent apart reorder the hosts: the chain keeps each rack together."""
    g, ups = racks(per_rack=4)
    rng = random.Random(seed)
    for _, _, d in g.edges(data=True):
        d["capacity"] *= rng.uniform(0.9, 1.0)
    loads = link_payloads(plan_pipelined_round(g, ups), g, "ps")
    assert max(loads.values()) == 1 and loads[("core", "ps")] == 1


def test_schedule_passes_the_pipelined_checker_only() -> None:
    g, ups = racks(per_rack=3)
    ups = [Update(u.update_id, u.src, u.dst, u.bytes, ready_at=0.01 * i) for i, u in enumerate(ups)]
    t = plan_pipelined_round(g, ups)
    s = pipelined_schedule(t, g, ups)
    piped = {a.aggregate_id for a in s.aggregates}
    assert piped and {m for a in s.aggregates for m in a.members if m.startswith("u")} | {
        x for x in s.arrivals if x.startswith("u")
    } == {u.update_id for u in ups}
    result = check_schedule(g, s, updates=ups, pipelined=piped)
    assert set(result.delays) == {u.update_id for u in ups}  # each update applied once
    end = max(x.end for x in s.transfers)
    assert end == pytest.approx(0.05 + t.busiest + 6 * t.chunk_bytes / (MB / t.busiest), rel=0.2)
    with pytest.raises(ScheduleError, match="before member"):  # not store-and-forward
        check_schedule(g, s, updates=ups)


def test_checker_rejects_an_aggregate_ahead_of_its_member() -> None:
    g = star(["ps", "a", "x"], 8.0)  # 1 byte/s
    ups = [Update("u", "a", "ps", 2.0)]
    member = Transfer.at_rate("u", ("a", "sw", "x"), start=0.0, bytes=2.0, rate=1.0)
    ok = Transfer.at_rate("g", ("x", "sw", "ps"), start=0.5, bytes=2.0, rate=1.0)
    agg = Aggregate("g", "x", ("u",), 2.0, "ps")
    check_schedule(g, Schedule.aggregated([member, ok], [agg]), updates=ups, pipelined={"g"})
    ahead = Transfer.at_rate("g", ("x", "sw", "ps"), start=0.5, bytes=2.0, rate=0.8)  # ends 3.0
    check_schedule(g, Schedule.aggregated([member, ahead], [agg]), updates=ups, pipelined={"g"})
    early = Transfer.at_rate("g", ("x", "sw", "ps"), start=0.0, bytes=2.0, rate=1.0)  # level, fine
    check_schedule(g, Schedule.aggregated([member, early], [agg]), updates=ups, pipelined={"g"})
    g2 = star(["ps", "a", "x"], 16.0)
    fast = Transfer.at_rate("g", ("x", "sw", "ps"), start=0.5, bytes=2.0, rate=2.0)  # ends 1.5 < 2
    with pytest.raises(ScheduleError, match="pipelined aggregate 'g' has forwarded"):
        check_schedule(g2, Schedule.aggregated([member, fast], [agg]), updates=ups, pipelined={"g"})


def test_hosts_that_may_not_sum_stay_leaves() -> None:
    g, ups = racks(per_rack=2)
    t = plan_pipelined_round(g, ups, aggregators={"h0", "h2"})
    assert set(t.aggregators()) <= {"h0", "h2"}
    assert plan_pipelined_round(g, ups, aggregators=()).shape == "direct"


def test_bad_rounds_are_refused() -> None:
    g, ups = racks()
    with pytest.raises(ValueError, match="one server host"):
        plan_pipelined_round(g, [*ups, Update("v", "h1", "h0", MB)])
    with pytest.raises(ValueError, match="at least one"):
        plan_pipelined_round(g, [])


def test_a_round_without_a_pipelined_tree_is_planned_store_and_forward() -> None:
    """Two updates at a host that may not sum them: no pipelined tree, the round still gets a plan."""
    policy = make_policy("stf+tree", sync=True, pipelined_aggregates=True).policy
    assert isinstance(policy, TreePolicy)
    g = star(["ps", "a", "b"], 1e6)
    ups = [Update("a/1", "a", "ps", MB), Update("a/2", "a", "ps", MB), Update("b/1", "b", "ps", MB)]
    with pytest.raises(ValueError, match="may not aggregate"):
        plan_pipelined_round(g, ups, aggregators=())
    snap = Snapshot(0.0, g, aggregators=frozenset())
    schedule, _, decision = policy._plan_round(snap, ups, PathCache(g))
    assert {"a/1", "a/2", "b/1"} <= {t.payload_id for t in schedule.transfers}
    assert all(a.chunk_bytes == 0 for a in decision.aggregates)
