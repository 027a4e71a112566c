"""The model down the trees (issue 23): the relay-tree planner, its checker and the relay limit."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import hosts, star, two_tier
from mlfabric.scheduler.policies.broadcast import (
    MAX_CHUNKS,
    BroadcastEdge,
    BroadcastError,
    BroadcastPlan,
    broadcast_bound,
    check_broadcast,
    estimate_arrivals,
    pipeline_chunks,
    plan_broadcast,
)

MB = 1_000_000


def two_racks() -> tuple[nx.DiGraph, list[str]]:
    """The issue's instance: two racks of six (10 Gbit/s NICs, 1 Gbit/s uplinks), ``ps`` on the core."""
    g = two_tier(2, 6, 10e9, oversubscription=60)
    g.add_node("ps", kind="host")
    for a, b in (("ps", "core"), ("core", "ps")):
        g.add_edge(a, b, capacity=10e9 / 8, latency=0.0)
    return g, [f"h{i}" for i in range(12)]


def pods() -> tuple[nx.DiGraph, list[str]]:
    """Three levels: ``ps`` on the core, two pods behind 1 Gbit/s, two racks per pod behind
    2.5 Gbit/s, three hosts per rack at 10 Gbit/s."""
    g = nx.DiGraph()

    def link(a: str, b: str, gbps: float) -> None:
        g.add_edge(a, b, capacity=gbps * 1e9 / 8, latency=0.0)
        g.add_edge(b, a, capacity=gbps * 1e9 / 8, latency=0.0)

    for s in ("core", "pod0", "pod1", "tor00", "tor01", "tor10", "tor11"):
        g.add_node(s, kind="switch")
    g.add_node("ps", kind="host")
    link("ps", "core", 10)
    names = []
    for p in range(2):
        link("core", f"pod{p}", 1)
        for t in range(2):
            link(f"pod{p}", f"tor{p}{t}", 2.5)
            for i in range(3):
                h = f"h{p}{t}{i}"
                g.add_node(h, kind="host")
                link(f"tor{p}{t}", h, 10)
                names.append(h)
    return g, names


def crossings(plan: BroadcastPlan, link: tuple[str, str]) -> int:
    """How many of the plan's edges (copies) cross ``link``."""
    return sum(link in zip(e.path, e.path[1:], strict=False) for e in plan.edges)


# -- the planner ------------------------------------------------------------------------------


def test_star_with_a_fat_server_nic_keeps_the_direct_copies() -> None:
    ws = [f"w{i}" for i in range(8)]
    g = star(["ps", *ws], {"ps": 100e9, **dict.fromkeys(ws, 10e9)})
    plan = plan_broadcast(g, "ps", ws, 20 * MB)
    check_broadcast(g, plan, "ps", ws)
    assert plan.children("ps") == ws
    assert plan.shape == "star"


def test_star_with_equal_nics_relays_and_beats_the_direct_copies() -> None:
    ws = [f"w{i}" for i in range(8)]
    g = star(["ps", *ws], 10e9)
    plan = plan_broadcast(g, "ps", ws, 20 * MB)
    check_broadcast(g, plan, "ps", ws)
    assert len(plan.children("ps")) < len(ws)
    direct = estimate_arrivals(g, "ps", [("ps", w) for w in ws], 20 * MB, plan.chunks)
    assert plan.makespan < 0.5 * max(float(direct[w][-1]) for w in ws)


def test_two_tier_racks_get_one_copy_across_each_uplink() -> None:
    g = two_tier(3, 4, 10e9, oversubscription=8)
    rs = [h for h in hosts(g) if h != "h0"]
    plan = plan_broadcast(g, "h0", rs, 20 * MB)
    check_broadcast(g, plan, "h0", rs)
    for r in (1, 2):
        assert crossings(plan, ("core", f"tor{r}")) == 1
    assert plan.makespan <= 1.3 * broadcast_bound(g, "h0", rs, 20 * MB, chunks=plan.chunks).value


def test_two_racks_one_copy_per_rack_to_the_fastest_nic_within_the_target() -> None:
    g, rs = two_racks()
    g.edges["h4", "tor0"]["capacity"] = g.edges["tor0", "h4"]["capacity"] = 25e9 / 8
    g.edges["h9", "tor1"]["capacity"] = g.edges["tor1", "h9"]["capacity"] = 25e9 / 8
    plan = plan_broadcast(g, "ps", rs, 20 * MB)
    check_broadcast(g, plan, "ps", rs)
    assert plan.children("ps") == ["h4", "h9"]  # the relays: the fastest NIC of each rack
    assert crossings(plan, ("core", "tor0")) == crossings(plan, ("core", "tor1")) == 1
    bound = broadcast_bound(g, "ps", rs, 20 * MB, chunks=plan.chunks)
    assert bound.cut == pytest.approx(0.16)
    assert plan.makespan <= 1.3 * bound.value


def test_deeper_topology_recurses_one_copy_per_pod_and_per_rack() -> None:
    g, rs = pods()
    plan = plan_broadcast(g, "ps", rs, 20 * MB)
    check_broadcast(g, plan, "ps", rs)
    for p in range(2):
        assert crossings(plan, ("core", f"pod{p}")) == 1
        for t in range(2):
            assert crossings(plan, (f"pod{p}", f"tor{p}{t}")) == 1
    assert len(plan.children("ps")) == 2
    assert plan.makespan <= 1.3 * broadcast_bound(g, "ps", rs, 20 * MB, chunks=plan.chunks).value


def test_chunk_rule_and_override() -> None:
    g, rs = two_racks()
    assert plan_broadcast(g, "ps", rs, 20 * MB, chunks=1).chunks == 1
    assert plan_broadcast(g, "ps", rs, 20 * MB, chunks=40).chunks == 40
    assert 1 < plan_broadcast(g, "ps", rs, 20 * MB).chunks < 40
    assert plan_broadcast(g, "ps", rs, 10_000).chunks == 1  # below one minimum chunk
    assert pipeline_chunks(1e12, 1.0, 1e-9) == MAX_CHUNKS
    # more chunks, shorter pipeline fill: 40 chunks estimate faster than one (no per-chunk cost here)
    one = plan_broadcast(g, "ps", rs, 20 * MB, chunks=1)
    many = plan_broadcast(g, "ps", rs, 20 * MB, chunks=40)
    assert many.makespan < one.makespan


def test_relays_restrict_who_forwards_and_may_add_a_relay_only_host() -> None:
    g, rs = two_racks()
    receivers = [h for h in rs if h not in ("h5", "h11")]
    plan = plan_broadcast(g, "ps", receivers, 20 * MB, relays=["h5", "h11"])
    check_broadcast(g, plan, "ps", receivers)
    assert sorted(plan.children("ps")) == ["h11", "h5"]  # a relay-only host per rack
    forwarders = {e.parent for e in plan.edges} - {"ps"}
    assert forwarders <= {"h5", "h11"}
    # no relay allowed at all: every copy from the source
    plan = plan_broadcast(g, "ps", rs, 20 * MB, relays=[])
    check_broadcast(g, plan, "ps", rs)
    assert plan.children("ps") == rs


def test_no_receivers_and_bad_input() -> None:
    g, rs = two_racks()
    empty = plan_broadcast(g, "ps", [], 20 * MB)
    assert empty.edges == () and empty.makespan == 0.0
    check_broadcast(g, empty, "ps", [])
    with pytest.raises(BroadcastError, match="not a host"):
        plan_broadcast(g, "ps", ["h0", "core"], 20 * MB)
    with pytest.raises(BroadcastError, match="distinct"):
        plan_broadcast(g, "ps", ["h0", "h0"], 20 * MB)
    with pytest.raises(BroadcastError, match="distinct"):
        plan_broadcast(g, "ps", ["ps", "h0"], 20 * MB)
    with pytest.raises(BroadcastError, match="chunks"):
        plan_broadcast(g, "ps", rs, 20 * MB, chunks=0)


# -- the checker: each invariant has a plan that breaks it -----------------------------------


def _edge(plan: BroadcastPlan, child: str) -> int:
    return next(i for i, e in enumerate(plan.edges) if e.child == child)


def _with(plan: BroadcastPlan, edges: list[BroadcastEdge]) -> BroadcastPlan:
    return replace(plan, edges=tuple(edges))


@pytest.fixture
def planned() -> tuple[nx.DiGraph, BroadcastPlan, list[str]]:
    g, rs = two_racks()
    plan = plan_broadcast(g, "ps", rs, 20 * MB)
    check_broadcast(g, plan, "ps", rs)
    return g, plan, rs


def test_checker_source(planned: tuple[nx.DiGraph, BroadcastPlan, list[str]]) -> None:
    g, plan, rs = planned
    with pytest.raises(BroadcastError, match=r"^source"):
        check_broadcast(g, plan, "h0", rs)
    with pytest.raises(BroadcastError, match=r"^source"):
        check_broadcast(g, replace(plan, chunks=0), "ps", rs)


def test_checker_once(planned: tuple[nx.DiGraph, BroadcastPlan, list[str]]) -> None:
    g, plan, rs = planned
    edges = list(plan.edges)
    leaf = edges[-1].child  # parents come first: the last child forwards nothing
    g.add_node("h12", kind="host")
    with pytest.raises(BroadcastError, match=r"^once: receiver 'h12' gets no copy"):
        check_broadcast(g, plan, "ps", [*rs, "h12"])
    with pytest.raises(BroadcastError, match=rf"^once: '{leaf}' receives the model twice"):
        check_broadcast(g, _with(plan, [*edges, edges[-1]]), "ps", rs)
    back = BroadcastEdge(leaf, "ps", tuple(nx.shortest_path(g, leaf, "ps")), 1.0)
    with pytest.raises(BroadcastError, match=r"^once: the source 'ps' receives"):
        check_broadcast(g, _with(plan, [*edges, back]), "ps", rs)
    with pytest.raises(BroadcastError, match=rf"^once: '{leaf}' is no receiver and forwards nothing"):
        check_broadcast(g, plan, "ps", [r for r in rs if r != leaf])
    to_switch = BroadcastEdge("h0", "tor0", ("h0", "tor0"), 1.0)
    with pytest.raises(BroadcastError, match=r"^once: 'tor0' .* not a host"):
        check_broadcast(g, _with(plan, [*edges, to_switch]), "ps", rs)


def test_checker_no_cycles(planned: tuple[nx.DiGraph, BroadcastPlan, list[str]]) -> None:
    g, plan, rs = planned
    edges = list(plan.edges)
    relay = plan.children("ps")[0]
    child = plan.children(relay)[0]
    # the relay receives from its own child: relay -> child -> relay
    edges[_edge(plan, relay)] = BroadcastEdge(child, relay, tuple(nx.shortest_path(g, child, relay)), 1.0)
    with pytest.raises(BroadcastError, match=r"^no cycles"):
        check_broadcast(g, _with(plan, edges), "ps", rs)


def test_checker_parents_first(planned: tuple[nx.DiGraph, BroadcastPlan, list[str]]) -> None:
    g, plan, rs = planned
    edges = list(plan.edges)
    relay = plan.children("ps")[0]
    i, j = _edge(plan, relay), _edge(plan, plan.children(relay)[0])
    swapped = edges.copy()
    swapped[i], swapped[j] = edges[j], edges[i]  # a child listed before its parent receives
    with pytest.raises(BroadcastError, match=r"^parents first: .* before it receives"):
        check_broadcast(g, _with(plan, swapped), "ps", rs)
    early = edges.copy()
    early[j] = replace(edges[j], expected=edges[i].expected / 2)
    with pytest.raises(BroadcastError, match=r"^parents first: .* before its parent"):
        check_broadcast(g, _with(plan, early), "ps", rs)
    orphan = [e for e in edges if e.child != relay]  # the relay forwards, never receives
    with pytest.raises(BroadcastError, match=rf"^parents first: '{relay}' forwards .* never receives"):
        check_broadcast(g, _with(plan, orphan), "ps", [r for r in rs if r != relay])


def test_checker_paths(planned: tuple[nx.DiGraph, BroadcastPlan, list[str]]) -> None:
    g, plan, rs = planned
    edges = list(plan.edges)
    i = _edge(plan, plan.children("ps")[0])
    e = edges[i]
    for bad, why in (
        ((*e.path[:-1], "h7" if e.child != "h7" else "h8"), "has path"),
        (("ps", e.child), "not a link"),
        ((*e.path[:-1], e.path[-2], e.child), "twice"),
    ):
        broken = edges.copy()
        broken[i] = replace(e, path=bad)
        with pytest.raises(BroadcastError, match=rf"^paths: .*{why}"):
            check_broadcast(g, _with(plan, broken), "ps", rs)


# -- the relay limit ---------------------------------------------------------------------------


def test_bound_on_two_racks_is_one_copy_across_an_uplink_plus_one_chunk_hop() -> None:
    g, rs = two_racks()
    b = broadcast_bound(g, "ps", rs, 20 * MB, chunks=10)
    assert b.where in ("link core->tor0", "link core->tor1")
    assert b.value == pytest.approx(0.16 + 2 * MB / 1.25e9)
    assert broadcast_bound(g, "ps", rs, 20 * MB, chunks=1).value == pytest.approx(0.176)
    assert broadcast_bound(g, "ps", rs, 20 * MB).chunks == plan_broadcast(g, "ps", rs, 20 * MB).chunks
    assert broadcast_bound(g, "ps", [], 20 * MB).value == 0.0


@pytest.mark.parametrize("chunks", [1, 4, 16])
def test_bound_is_below_every_plan(chunks: int) -> None:
    cases = [two_racks(), pods()]
    ws = [f"w{i}" for i in range(6)]
    cases.append((star(["ps", *ws], {"ps": 40e9, **dict.fromkeys(ws, 10e9)}), ws))
    for g, rs in cases:
        bound = broadcast_bound(g, "ps", rs, 20 * MB, chunks=chunks).value
        plan = plan_broadcast(g, "ps", rs, 20 * MB, chunks=chunks)
        direct = estimate_arrivals(g, "ps", [("ps", r) for r in rs], 20 * MB, chunks)
        assert bound <= plan.makespan * (1 + 1e-9)
        assert bound <= max(float(direct[r][-1]) for r in rs) * (1 + 1e-9)
    with pytest.raises(BroadcastError):
        broadcast_bound(g, "ps", rs, 20 * MB, chunks=0)
