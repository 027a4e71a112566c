"""The incremental STF decision (``STFBook``) decides exactly as the full re-plan (issue 24).

Seeded decision sequences — arrivals over time (some ready later than the decision), the
head of each decision released into flight, transfers ending, pending updates leaving or
changing, NIC capacities changing, the topology changing, time going back — are replayed
through ``STFPolicy(incremental=False)`` (a fresh plan from scratch each time, as before
issue 24) and one ``STFPolicy()`` kept across the sequence; every decision must be equal:
the same sends in the same order with the same ``after`` and the same expected times (bit
for bit), the same drops with the same reasons.
"""

from __future__ import annotations

import dataclasses
import random

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import PathCache, hosts, two_tier
from mlfabric.scheduler.policies.base import Decision, InFlight, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.stf import STFPolicy
from mlfabric.scheduler.policies.stf_book import rank_key

MB = 1_000_000
SERVERS = ("h0", "h5", "h10")


def graph(seed: int, racks: int = 4, per_rack: int = 8) -> nx.DiGraph:
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(racks * per_rack)]
    nic = {h: rng.choice((1e9, 10e9, 10e9, 25e9)) for h in names}
    return two_tier(racks, per_rack, nic, oversubscription=4.0)


def replay(
    seed: int, steps: int, horizon: int | None, per_rack: int = 8, shuffle: bool = True
) -> list[tuple[Decision, Decision]]:
    """Both policies' decisions along one seeded sequence (``per_rack`` 4: many updates per NIC).

    ``shuffle`` False: the pending updates listed as the simulator lists them (its dict's
    values: those kept in their order, new ones after them), so the book finds what changed
    by walking its last list and this one (STFBook.sync, issue 24).
    """
    rng = random.Random(seed)
    g = graph(seed, per_rack=per_rack)
    full, incremental = STFPolicy(horizon, incremental=False), STFPolicy(horizon)
    workers = [h for h in hosts(g) if h not in SERVERS]
    pending: dict[str, PendingUpdate] = {}
    flying: dict[str, InFlight] = {}
    versions = {("j", f"s{k}"): 0 for k in range(len(SERVERS))}
    now, serial, out = 0.0, 0, []
    for step in range(steps):
        now += rng.choice((0.0, 0.0005, 0.002, 0.01))
        if step % 17 == 16:
            now -= 0.004  # a clock that went back (the book starts over)
        for _ in range(rng.choice((0, 1, 5, 20))):
            k = rng.randrange(len(SERVERS))
            w = "nowhere" if rng.random() < 0.02 else rng.choice(workers)
            size = rng.choice((1, 5, 5, 20)) * MB * rng.choice((1.0, 1.0, 1.1))
            ready = now + rng.choice((0.0, 0.0, -0.001, 0.003))
            uid = f"u{serial}"
            serial += 1
            pending[uid] = PendingUpdate(
                uid,
                "j",
                f"s{k}",
                w,
                w,
                SERVERS[k],
                int(size),
                1.0,
                versions["j", f"s{k}"] - rng.randint(0, 3),
                ready,
            )
        for uid in rng.sample(sorted(pending), min(len(pending), rng.choice((0, 0, 1, 3)))):
            if rng.random() < 0.5:
                del pending[uid]  # left without a send (resent, dropped by the caller)
            else:  # changed under the same id
                p = pending[uid]
                pending[uid] = PendingUpdate(
                    uid,
                    p.job,
                    p.server,
                    p.worker,
                    p.src_host,
                    p.dst_host,
                    p.bytes * 2,
                    1.0,
                    p.base_version,
                    p.ready_at,
                )
        if step % 7 == 6:  # new capacity estimates on some NICs (same topology)
            g = g.copy()
            for h in rng.sample(workers, len(workers) // 2):
                for link in ((h, next(iter(g.successors(h)))), (next(iter(g.predecessors(h))), h)):
                    g.edges[link]["capacity"] = rng.choice((1e9, 5e9, 10e9))
        if step == steps // 2:  # another topology: the paths are rebuilt
            g = graph(seed, racks=5, per_rack=per_rack)
            workers = [h for h in hosts(g) if h not in SERVERS]
            pending = {u: p for u, p in pending.items() if p.src_host in g}
        flying = {u: f for u, f in flying.items() if f.expected_end > now}
        for key in versions:
            versions[key] += rng.choice((0, 0, 1))
        snap = Snapshot(now, g, tuple(flying.values()), dict(versions), {"j": rng.choice((-1, 4, 8))})
        ps = list(pending.values())
        if shuffle:
            rng.shuffle(ps)
        a = full.decide(snap, ps)
        b = incremental.decide(snap, ps)
        out.append((a, b))
        for s in a.sends[: rng.choice((0, 1, 4))]:  # the head leaves: in flight until its end
            p = pending.pop(s.update_id)
            flying[s.update_id] = InFlight(s.update_id, p.job, p.server, s.path, p.bytes, now, s.expected_end)
        for d in a.drops:
            pending.pop(d.update_id, None)
    return out


@pytest.mark.parametrize("horizon", [None, 8, 64])
@pytest.mark.parametrize(("seed", "per_rack"), [(1, 8), (2, 8), (3, 4), (4, 4)])
def test_incremental_decisions_equal_the_full_re_plan(seed: int, per_rack: int, horizon: int | None) -> None:
    pairs = replay(seed, steps=40, horizon=horizon, per_rack=per_rack)
    for step, (full, incremental) in enumerate(pairs):
        assert incremental == full, f"decision {step} differs"
    assert sum(len(a.sends) for a, _ in pairs) > 100
    assert any(a.drops for a, _ in pairs), "tau_max never dropped: the sequence tests too little"


def test_a_policy_decides_the_same_inputs_alike_twice_and_after_others() -> None:
    g = graph(5)
    pc = PathCache(g)
    ps = [
        PendingUpdate(f"u{i}", "j", "s", f"h{i}", f"h{i}", "h0", (1 + i % 3) * MB, 1.0, 0, 0.0)
        for i in range(1, 30)
    ]
    busy = (InFlight("f", "j", "s", pc.path("h3", "h0"), MB, 0.0, 0.002),)
    snap = Snapshot(0.001, g, busy)
    policy, want = STFPolicy(horizon=10), STFPolicy(horizon=10, incremental=False).decide(snap, ps)
    assert policy.decide(snap, ps) == want
    policy.decide(Snapshot(0.002, g), ps[:5])
    assert policy.decide(snap, ps) == want


def test_a_duplicate_id_is_refused_as_before() -> None:
    g = graph(6)
    p = PendingUpdate("u", "j", "s", "h1", "h1", "h0", MB, 1.0, 0, 0.0)
    q = PendingUpdate("v", "j", "s", "h2", "h2", "h0", MB, 1.0, 0, 0.0)
    for policy in (STFPolicy(), STFPolicy(incremental=False)):
        with pytest.raises(ValueError, match="update 'v' is listed twice"):
            policy.decide(Snapshot(0.0, g), [q, p, p, q])


def test_equal_copies_and_a_new_object_under_a_held_id_are_met_as_before() -> None:
    g = graph(6)
    ps = [
        PendingUpdate(f"u{i}", "j", "s", f"h{i}", f"h{i}", "h0", (1 + i % 3) * MB, 1.0, 0, 0.0)
        for i in range(1, 6)
    ]
    snap = Snapshot(0.0, g)
    policy, want = STFPolicy(), STFPolicy(incremental=False).decide(snap, ps)
    assert policy.decide(snap, ps) == want
    copies = [dataclasses.replace(p) for p in ps]  # equal, not the same objects
    assert policy.decide(snap, copies[::-1]) == want
    assert policy.decide(snap, ps) == want
    bigger = dataclasses.replace(ps[2], bytes=9 * MB)
    with pytest.raises(ValueError, match="update 'u3' is listed twice"):
        policy.decide(snap, [*ps, bigger])  # a new object under an id the book holds, both listed
    assert policy.decide(snap, ps) == want  # the book was left as it was
    changed = [*ps[:2], bigger, *ps[3:]]
    assert policy.decide(snap, changed) == STFPolicy(incremental=False).decide(snap, changed)


def test_a_graph_changed_in_place_under_a_new_version_is_read_again() -> None:
    g = graph(7)
    rng = random.Random(7)
    workers = [h for h in hosts(g) if h not in SERVERS]
    ps = [
        PendingUpdate(f"u{i}", "j", "s0", w, w, SERVERS[0], rng.choice((1, 5)) * MB, 1.0, 0, 0.0)
        for i, w in enumerate(workers)
    ]
    policy, full = STFPolicy(horizon=8), STFPolicy(horizon=8, incremental=False)
    for version in range(6):
        if version:  # the producer changes capacities of the same graph object, and the number
            for h in rng.sample(workers, len(workers) // 2):
                g.edges[h, next(iter(g.successors(h)))]["capacity"] = rng.choice((1e9, 5e9, 10e9))
        snap = Snapshot(0.001 * version, g, graph_version=version)
        for _ in range(2):  # the second time: nothing changed, nothing read again
            assert policy.decide(snap, ps) == full.decide(snap, ps), f"version {version}"


def test_rank_keys_sort_as_ready_time_then_id() -> None:
    rng = random.Random(0)
    pairs = [
        (rng.choice((-1.5, -0.0, 0.0, 1e-9, 2.5, 1e300)), rng.choice(("a", "ab", "b", "", "a\x01")))
        for _ in range(200)
    ]
    by_key = sorted(pairs, key=lambda p: rank_key(*p))
    assert [(t + 0.0, u) for t, u in by_key] == sorted((t + 0.0, u) for t, u in pairs)


def test_links_past_the_nic_changed_in_place_under_a_new_version_are_read_again() -> None:
    """The book numbers every link and the C loop keeps the capacities it reads (issue 24):
    a change of an uplink, a core link or the server's NIC under a new version is seen."""
    g = graph(8)
    rng = random.Random(8)
    workers = [h for h in hosts(g) if h not in SERVERS]
    ps = [
        PendingUpdate(f"u{i}", "j", "s0", w, w, SERVERS[0], rng.choice((1, 5)) * MB, 1.0, 0, 0.0)
        for i, w in enumerate(workers)
    ]
    inner = [(u, v) for u, v in g.edges if u not in workers and v not in workers]
    policy, full = STFPolicy(horizon=16), STFPolicy(horizon=16, incremental=False)
    seen = set()
    for version in range(8):
        if version:
            for link in rng.sample(inner, len(inner) // 3):
                g.edges[link]["capacity"] *= rng.choice((0.25, 0.5, 2.0))
        snap = Snapshot(0.001 * version, g, graph_version=version)
        for _ in range(2):
            got = policy.decide(snap, ps)
            assert got == full.decide(snap, ps), f"version {version}"
        seen.add(tuple((s.update_id, s.expected_end) for s in got.sends))
    assert len(seen) > 1, "the changes changed no plan: the test tests nothing"


def test_the_book_reads_capacities_of_the_timelines_graph_only() -> None:
    """Planning on timelines of another graph than the book's last sync reads that graph."""
    from mlfabric.scheduler.core.timeline import Timelines
    from mlfabric.scheduler.policies.stf_book import STFBook

    g = graph(9)
    workers = [h for h in hosts(g) if h not in SERVERS]
    ps = [PendingUpdate(f"u{i}", "j", "s0", w, w, SERVERS[0], MB, 1.0, 0, 0.0) for i, w in enumerate(workers)]
    book = STFBook()
    book.sync(g, 0.0, ps, graph_version=1)
    first = book.plan_times(Timelines(g), 0.0, {}, {})
    slow = g.copy()
    for link in slow.edges:
        slow.edges[link]["capacity"] /= 2
    again = book.plan_times(Timelines(slow), 0.0, {}, {})
    assert [t.end for t in again[0]] == [2 * t.end for t in first[0]]


@pytest.mark.parametrize("horizon", [None, 8])
@pytest.mark.parametrize(("seed", "per_rack"), [(5, 8), (6, 4), (7, 4)])
def test_in_order_updates_plan_as_a_full_re_plan(seed: int, per_rack: int, horizon: int | None) -> None:
    """The book's walk of its last list and the new one (no set of every id per decision) plans
    as the full re-plan; equal copies and ids listed twice take the set operations."""
    pairs = replay(seed, steps=40, horizon=horizon, per_rack=per_rack, shuffle=False)
    for step, (full, incremental) in enumerate(pairs):
        assert incremental == full, f"decision {step} differs"
    assert sum(len(a.sends) for a, _ in pairs) > 100


def test_the_walk_finds_what_the_set_operations_find() -> None:
    """_plan_native.list_diff against sets of ids on seeded lists: taken out, added, moved, twice."""
    from mlfabric.scheduler.policies import stf_book

    assert stf_book._plan_native is not None
    diff = stf_book._plan_native.list_diff
    rng = random.Random(11)
    walked = 0
    for _ in range(2000):
        old = [object() for _ in range(rng.randrange(0, 12))]
        new = [x for x in old if rng.random() < 0.8] + [object() for _ in range(rng.choice((0, 0, 1, 3)))]
        if new and rng.random() < 0.2:
            i, j = rng.randrange(len(new)), rng.randrange(len(new))
            new[i], new[j] = new[j], new[i]  # moved
        if new and rng.random() < 0.1:
            new.append(rng.choice(new))  # listed twice
        got = diff(old, new)
        ids_old, ids_new = set(map(id, old)), list(map(id, new))
        in_order = [x for x in new if id(x) in ids_old] == [x for x in old if id(x) in set(ids_new)]
        plain = (
            len(set(ids_new)) == len(ids_new)
            and in_order
            and all(id(x) not in ids_old for x in new[len([x for x in new if id(x) in ids_old]) :])
        )
        if got is None:
            assert not plain, (old, new)
            continue
        walked += 1
        added, taken = got
        assert plain
        assert added == [x for x in new if id(x) not in ids_old]
        assert taken == [x for x in old if id(x) not in set(ids_new)]
    assert walked > 1000
