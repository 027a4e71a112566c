"""The STF loop in C (``_plan_native.stf_run``) against the Python loop it stands in for (issue 24).

Every case runs with the C module and again with it switched off everywhere (the Python
loops, as where the extension is not built) and compares the ``repr`` of what comes out —
sends, times to the last bit, ``after`` lists, drops and their reasons — and the timelines
left behind: seeded decision sequences through both the incremental book and the plan
from scratch (arrivals, departures, NIC changes, a new topology, the clock going back,
tau_max drops, horizons), and the corners: a path with no residual bandwidth, capacity
profiles, updates on their server's host, ``limit``, times that are not floats.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import PathCache, star, two_tier
from mlfabric.scheduler.core.schedule import TransferTimes, Update
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies import stf_planner
from mlfabric.scheduler.policies.base import PendingUpdate
from mlfabric.scheduler.policies.convert import times_to_decision
from mlfabric.scheduler.policies.stf import plan_stf
from mlfabric.scheduler.policies.stf_book import STFBook
from tests.scheduler.test_plan_native import MODULES, both, python_loops, state
from tests.scheduler.test_stf_incremental import replay

MB = 1_000_000


def test_the_stf_loop_is_switched_off_with_the_others() -> None:
    assert stf_planner in MODULES  # both() runs the Python loop of the STF planner too
    assert stf_planner._plan_native is not None


@pytest.mark.parametrize("horizon", [None, 8, 256])
@pytest.mark.parametrize(("seed", "per_rack"), [(1, 8), (3, 4), (7, 4)])
def test_decision_sequences_are_the_python_ones(seed: int, per_rack: int, horizon: int | None) -> None:
    native, python = both(lambda: replay(seed, steps=30, horizon=horizon, per_rack=per_rack))
    assert native == python
    assert "drops=()" in native and "reason=" in native  # tau_max dropped some, not all


def seeded_plan(seed: int) -> object:
    """plan_stf on a seeded two-tier graph: transfers in flight, profiles, zero links, tau_max."""
    rng = random.Random(seed)
    racks, per = rng.choice([(2, 3), (3, 4), (4, 8)])
    n = racks * per
    g = two_tier(racks, per, {f"h{i}": rng.choice([1e9, 10e9, 25e9]) for i in range(n)}, oversubscription=4)
    servers = ["h0", f"h{n - 1}"]
    profiles = {}
    if rng.random() < 0.5:  # a NIC whose capacity varies over time
        h = f"h{rng.randrange(1, n - 1)}"
        link = (h, next(iter(g.successors(h))))
        profiles[link] = [(0.001, 1e8), (0.004, 2e9)]
    tls = Timelines(g, start=0.0, profiles=profiles)
    pc = PathCache(g)
    for k in rng.sample(range(1, n - 1), max(1, n // 5)):
        tls.reserve_until(pc.links(f"h{k}", servers[k % 2]), 0.0, rng.random() * 0.01)
    if rng.random() < 0.3:  # a worker whose NIC is never free again: its updates are dropped
        h = f"h{rng.randrange(1, n - 1)}"
        tl = tls.link((h, next(iter(g.successors(h)))))
        tl.residual[-1] = 0.0
    us = [
        Update(
            f"u{i}",
            servers[i % 2]
            if rng.random() < 0.05
            else f"h{rng.randrange(n)}",  # on its server's host: no links
            servers[i % 2],
            rng.choice([1, 5, 20]) * MB * rng.choice([1.0, 1.1]),
            ready_at=rng.choice([0.0, 0.0, rng.random() * 0.005]),
            base_version=rng.randrange(4),
            server=servers[i % 2],
        )
        for i in range(rng.randrange(1, 4 * n))
    ]
    tau: int | dict[str, int] | None = rng.choice([None, 2, {servers[0]: 1, servers[1]: 6}])
    versions: list[int | dict[str, int]] = [0, 3, {servers[0]: 2}]
    version = rng.choice(versions)
    limit = rng.choice([None, None, 1, 7])
    s = plan_stf(g, us, now=0.0, timelines=tls, paths=pc, tau_max=tau, server_version=version, limit=limit)
    # the Python walk makes a timeline for every link it reads, the C only for those it
    # reserves: one made and never reserved reads as the graph's capacity, as an absent one
    untouched = {link for link, tl in tls._links.items() if tl.residual == [g.edges[link]["capacity"]]}
    return s, [row for row in state(tls) if row[0] not in untouched]


@pytest.mark.parametrize("seed", range(40))
def test_plans_are_the_python_ones(seed: int) -> None:
    native, python = both(lambda: seeded_plan(seed))
    assert native == python


def test_the_corners_are_covered() -> None:
    plans = [repr(seeded_plan(seed)) for seed in range(40)]
    assert any("no residual bandwidth" in p for p in plans)
    assert any("expected delay" in p for p in plans)


def test_a_path_with_no_residual_is_dropped_with_the_python_reason() -> None:
    g = star(["ps", "a", "b"], 8e6)
    g.edges["b", "sw"]["capacity"] = 0.0
    us = [Update("x", "a", "ps", 1e6), Update("y", "b", "ps", 1e6), Update("z", "ps", "ps", 1e6)]
    native, python = both(lambda: plan_stf(g, us))
    assert native == python
    assert "no residual bandwidth: path" in native


def test_int_times_run_the_python_loop() -> None:
    g = star(["ps", "a", "b"], 8e6)
    us = [Update("x", "a", "ps", 1e6), Update("y", "b", "ps", 2e6, ready_at=1)]
    native, python = both(lambda: plan_stf(g, us, now=0))
    assert native == python
    got = plan_stf(g, us, now=0)
    assert [t.payload_id for t in got.transfers] == ["x", "y"]


def test_a_missing_link_raises_as_in_python() -> None:
    g = nx.DiGraph()
    g.add_edge("a", "b", capacity=1.0)
    pc = PathCache(g)
    g2 = nx.DiGraph()
    g2.add_edge("a", "c", capacity=1.0)
    for switched_off in (False, True):
        saved = stf_planner._plan_native
        try:
            if switched_off:
                stf_planner._plan_native = None  # type: ignore[assignment]
            with pytest.raises(KeyError, match="no link"):
                plan_stf(g2, [Update("x", "a", "b", 1.0)], paths=pc)
        finally:
            stf_planner._plan_native = saved


def book_plan(seed: int, light: bool) -> object:
    """A seeded book planned as a Schedule or as TransferTimes rows: the times, drops, timelines."""
    rng = random.Random(seed)
    g = two_tier(3, 4, {f"h{i}": rng.choice([1e9, 10e9]) for i in range(12)}, oversubscription=4)
    pending = [
        PendingUpdate(
            f"u{i}", "j", f"s{i % 2}", f"h{k}", f"h{k}", f"h{i % 2}", rng.choice([1, 5]) * MB, 1.0, 0, 0.0
        )
        for i, k in enumerate(rng.choices(range(2, 12), k=30))
    ]
    book = STFBook()
    book.sync(g, 0.0, pending)
    tls = Timelines(g, start=0.0)
    busy = PathCache(g).links("h3", "h0")
    tls.reserve_until(busy, 0.0, 0.002)  # a NIC in use
    tau, versions, limit = {"j/s0": 3}, {"j/s0": 4}, rng.choice([None, 9])
    if light:
        times, drops = book.plan_times(tls, 0.0, tau, versions, touched=busy, limit=limit)
    else:
        plan = book.plan(tls, 0.0, tau, versions, touched=busy, limit=limit)
        times, drops = tuple(map(TransferTimes.of, plan.transfers)), dict(plan.drops)
    return times, drops, [row for row in state(tls) if len(row[1]) > 1]  # (Python makes more, unreserved)


@pytest.mark.parametrize("seed", range(6))
def test_the_light_plan_is_the_schedules_in_c_and_in_python(seed: int) -> None:
    native_plan, python_plan = both(lambda: book_plan(seed, light=False))
    native_light, python_light = both(lambda: book_plan(seed, light=True))
    assert native_light == native_plan == python_plan == python_light
    assert "TransferTimes(" in native_light and "expected delay" in native_light


def test_the_light_rows_and_their_sends_are_left_out_of_the_cyclic_collector() -> None:
    g = star(["ps", "a", "b"], 8e6)
    mk = lambda uid, host: PendingUpdate(uid, "j", "s", host, host, "ps", MB, 1.0, 0, 0.0)  # noqa: E731
    book = STFBook()
    book.sync(g, 0.0, [mk("x", "a"), mk("y", "b")])
    times, _ = book.plan_times(Timelines(g), 0.0, {}, {})
    assert [t.payload_id for t in times] == ["x", "y"]
    assert not any(gc.is_tracked(t) or gc.is_tracked(t.path) for t in times)
    sends = times_to_decision(times, {}).sends
    assert [s.after for s in sends] == [(), ("x",)]
    assert not any(gc.is_tracked(s) for s in sends)
    plan = book.plan(Timelines(g), 0.0, {}, {})  # a Schedule's transfers keep their records
    assert plan.transfers[0].reservations and gc.is_tracked(plan.transfers[0])


def test_changed_capacities_are_the_python_scan() -> None:
    g = star(["ps", "a", "b", "c"], 8e6)
    g.edges["b", "sw"]["capacity"] = 4  # an int, equal to the float it was classed by
    g.edges["c", "sw"]["capacity"] = float("nan")
    book = STFBook()
    mk = lambda uid, host: PendingUpdate(uid, "j", "s", host, host, "ps", MB, 1.0, 0, 0.0)  # noqa: E731
    book.sync(g, 0.0, [mk("x", "a"), mk("y", "b"), mk("z", "c")])
    caps = dict(book._caps)
    assert set(caps) == {("a", "sw"), ("b", "sw"), ("c", "sw")}
    caps["b", "sw"] = 4.0
    g.edges["a", "sw"]["capacity"] = 2e6
    changed = [("a", "sw"), ("c", "sw")]  # nan != nan
    assert stf_planner._plan_native is not None
    assert stf_planner._plan_native.changed_capacities(caps, g._succ) == changed
    assert [link for link, cap in caps.items() if g._succ[link[0]][link[1]]["capacity"] != cap] == changed
    with pytest.raises(KeyError):
        stf_planner._plan_native.changed_capacities({("a", "nowhere"): 1.0}, g._succ)


def book_plan_kept(seed: int, keep: bool) -> tuple[object, list[tuple[Any, list[float], list[float], float]]]:
    """A seeded book's light plan (a NIC of no capacity among them), and the timelines left."""
    rng = random.Random(seed)
    g = two_tier(3, 4, {f"h{i}": rng.choice([1e9, 10e9]) for i in range(12)}, oversubscription=4)
    dead = f"h{rng.randrange(2, 12)}"
    g.edges[dead, next(iter(g.successors(dead)))]["capacity"] = 0.0  # its updates: no residual, ever
    pending = [
        PendingUpdate(
            f"u{i}", "j", f"s{i % 2}", f"h{k}", f"h{k}", f"h{i % 2}", rng.choice([1, 5]) * MB, 1.0, 0, 0.0
        )
        for i, k in enumerate(rng.choices(range(2, 12), k=30))
    ]
    book = STFBook()
    book.sync(g, 0.0, pending)
    tls = Timelines(g, start=0.0)
    busy = PathCache(g).links("h3", "h0")
    tls.reserve_until(busy, 0.0, 0.002)
    got = book.plan_times(tls, 0.0, {"j/s0": 3}, {"j/s0": 4}, touched=busy, keep_timelines=keep)
    return got, [row for row in state(tls) if len(row[1]) > 1]


@pytest.mark.parametrize("seed", range(8))
def test_a_plan_that_drops_its_timelines_is_the_same_plan(seed: int) -> None:
    """keep_timelines=False: the C loop leaves out of the Timelines the timelines it made, and
    puts them there before the Python reads it (a path with no residual: its drop's reason)."""
    kept, kept_state = book_plan_kept(seed, True)
    with python_loops():
        python, python_state = book_plan_kept(seed, True)
    dropped, dropped_state = book_plan_kept(seed, False)
    assert kept == dropped == python and kept_state == python_state
    assert "no residual bandwidth" in repr(kept)
    assert len(dropped_state) < len(kept_state)  # (the timelines of the transfers it planned: left out)


def test_a_book_member_not_as_the_c_reads_it_raises_when_its_head_is_reached() -> None:
    # the book's classes are taken lazily (only their heads are read), so a member is checked
    # as it is taken, not in a pass over every member of every class before the loop
    g = star(["ps", "a", "b"], 8e6)
    mk = lambda uid, host, size: PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)  # noqa: E731
    book = STFBook()
    book.sync(g, 0.0, [mk("x", "a", 1e6), mk("y", "b", 2e6)])
    times, _ = book.plan_times(Timelines(g), 0.0, {}, {})
    assert [t.payload_id for t in times] == ["x", "y"]
    members = next(iter(book._groups.values()))
    nbytes, key = members[0]
    members[0] = (int(nbytes), key)
    with pytest.raises(TypeError, match="members must be"):
        book.plan_times(Timelines(g), 0.0, {}, {})
