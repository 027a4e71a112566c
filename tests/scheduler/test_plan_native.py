"""The C loops of ``_plan_native`` against the Python they stand in for (issue 24).

Each case runs once with the C module and once with every module's ``_plan_native`` set to
None (the Python loops, as where the extension is not built), and compares the ``repr`` of
what comes out (every float to the last bit) and the timelines left behind.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import networkx as nx
import pytest

from mlfabric.scheduler.core import records, timeline
from mlfabric.scheduler.core.graph import PathCache, two_tier
from mlfabric.scheduler.core.schedule import Update
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies import (
    convert,
    dispatch,
    stf_book,
    stf_planner,
    tree_cost,
    tree_routes,
    trees,
)
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.tree_policy import TreePolicy
from mlfabric.scheduler.policies.trees import plan_tree

MB = 1_000_000
MODULES = (timeline, records, tree_cost, tree_routes, trees, convert, stf_planner, stf_book, dispatch)


@contextmanager
def python_loops() -> Iterator[None]:
    saved = [m._plan_native for m in MODULES]
    try:
        for m in MODULES:
            m._plan_native = None  # type: ignore[attr-defined]
        yield
    finally:
        for m, native in zip(MODULES, saved, strict=True):
            m._plan_native = native  # type: ignore[attr-defined]


def both(make: Callable[[], Any]) -> tuple[str, str]:
    native = repr(make())
    with python_loops():
        python = repr(make())
    return native, python


def test_the_extension_is_built() -> None:
    # pip install builds it; without it the planner is the Python loops (same plans, slower)
    assert timeline._plan_native is not None


def state(tls: Timelines) -> list[tuple[Any, list[float], list[float], float]]:
    return [(link, tl.times, tl.residual, tl.eps) for link, tl in sorted(tls._links.items())]


def random_reservations(seed: int) -> object:
    """Transfers on a small two-tier graph after some in flight: walks over reserved links."""
    rng = random.Random(seed)
    g = two_tier(2, 3, {f"h{i}": rng.choice([1e9, 2.5e9, 10e9]) for i in range(6)}, oversubscription=2)
    pc = PathCache(g)
    tls = Timelines(g, start=0.0)
    hosts = [f"h{i}" for i in range(6)]
    for _ in range(rng.randrange(0, 4)):  # in flight: whole residuals taken for a while
        a, b = rng.sample(hosts, 2)
        tls.reserve_until(pc.links(a, b), rng.random() * 0.01, 0.01 + rng.random() * 0.02)
    out: list[object] = []
    for k in range(40):
        a, b = rng.sample(hosts, 2)
        path = pc.path(a, b) if rng.random() < 0.9 else (a,)
        nbytes = rng.choice([0, 1, 5 * MB, 20 * MB, rng.random() * 10 * MB])
        ready = rng.choice([0.0, rng.random() * 0.05, float(k) * 1e-3])
        if rng.random() < 0.3:  # a walk without a reservation (Timelines.ten)
            out.append(tls.ten(list(itertools.pairwise(path)), nbytes, ready))
        elif rng.random() < 0.5:
            out.append(tls.transfer(f"p{k}", path, nbytes, ready))
        else:
            out.append(tls.reserve(list(itertools.pairwise(path)), nbytes, ready, who=f"p{k}"))
    return out, state(tls)


@pytest.mark.parametrize("seed", range(30))
def test_transfers_on_timelines_are_the_python_ones(seed: int) -> None:
    native, python = both(lambda: random_reservations(seed))
    assert native == python


def test_a_path_never_free_raises_as_in_python() -> None:
    g = nx.DiGraph()
    g.add_edge("a", "b", capacity=4.0)
    g.add_edge("b", "c", capacity=4.0)
    for loops in (False, True):
        tls = Timelines(g)
        tls.reserve_until([("b", "c")], 0.0, 1.0)
        tls.link(("b", "c")).residual[-1] = 0.0  # never free again
        if loops:
            with python_loops(), pytest.raises(ValueError, match="never has residual bandwidth"):
                tls.transfer("u", ("a", "b", "c"), 4.0, 0.0)
        else:
            with pytest.raises(ValueError, match="never has residual bandwidth"):
                tls.transfer("u", ("a", "b", "c"), 4.0, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_a_copy_of_timelines_is_the_python_one_and_independent(seed: int) -> None:
    def copies() -> object:
        rng = random.Random(seed)
        g = two_tier(2, 3, {f"h{i}": 1e9 for i in range(6)}, oversubscription=2)
        pc = PathCache(g)
        tls = Timelines(g, start=0.0)
        for _ in range(5):
            a, b = rng.sample([f"h{i}" for i in range(6)], 2)
            tls.reserve(pc.links(a, b), 1e6 * rng.random(), rng.random() * 0.01)
        before = state(tls)
        copy = tls.copy()
        assert state(copy) == before and all(copy._links[k] is not v for k, v in tls._links.items())
        copy.reserve(pc.links("h0", "h5"), 5e6, 0.0)  # the original keeps its own
        assert state(tls) == before
        return state(copy)

    native, python = both(copies)
    assert native == python


def test_ten_on_a_path_never_free_makes_the_python_timelines_and_raises() -> None:
    g = nx.DiGraph()
    for u, v in [("a", "b"), ("b", "c"), ("c", "d")]:
        g.add_edge(u, v, capacity=4.0)
    g.edges["b", "c"]["capacity"] = 0.0

    def walk() -> object:
        tls = Timelines(g)
        with pytest.raises(ValueError, match="never has residual bandwidth") as err:
            tls.ten([("a", "b"), ("b", "c"), ("c", "d")], 4.0, 0.0)
        return str(err.value), sorted(tls._links)  # made up to the link that is never free

    native, python = both(walk)
    assert native == python
    assert native.endswith("[('a', 'b'), ('b', 'c')])")


def test_int_times_run_the_python_loops() -> None:
    g = nx.DiGraph()
    g.add_edge("a", "b", capacity=4.0)
    native, python = both(lambda: Timelines(g, start=0).transfer("u", ("a", "b"), 8, 1))
    assert native == python


def seeded_round(seed: int) -> object:
    """plan_tree on a seeded instance: sizes, ready times, racks, in flight, local search or not."""
    rng = random.Random(seed)
    racks, per = rng.choice([(2, 3), (3, 4), (4, 6), (6, 16)])
    n = racks * per
    g = two_tier(racks, per, {f"h{i}": rng.choice([2.5e9, 10e9, 25e9]) for i in range(n)}, oversubscription=4)
    us = [
        Update(f"u{i}", f"h{i}", "h0", rng.choice([5, 20]) * MB, ready_at=rng.random() * 0.01)
        for i in range(1, n)
    ]
    tls = None
    if rng.random() < 0.5:
        tls = Timelines(g, start=0.0)
        pc = PathCache(g)
        for k in rng.sample(range(1, n), max(1, n // 6)):
            tls.reserve_until(pc.links(f"h{k}", "h0"), 0.0, rng.random() * 0.01)
    s = plan_tree(g, us, timelines=tls, local_search=rng.random() < 0.5)
    return s.transfers, s.aggregates, None if tls is None else state(tls)  # the timelines left behind


@pytest.mark.parametrize("seed", range(12))
def test_tree_plans_are_the_python_ones(seed: int) -> None:
    native, python = both(lambda: seeded_round(seed))
    assert native == python


def test_tree_decisions_are_the_python_ones() -> None:
    """TreePolicy decisions (the decision adapter's ``after`` included), in flight on some uplinks."""

    def decide() -> object:
        g = two_tier(8, 16, {f"h{i}": 10e9 if i % 5 else 2.5e9 for i in range(128)}, oversubscription=4)
        pc = PathCache(g)
        busy = tuple(
            InFlight(f"f{i}", "j", "s", pc.path(f"h{i}", "h0"), 10 * MB, 0.0, 0.004 + 0.001 * (i % 7))
            for i in range(64, 80)
        )
        ps = [
            PendingUpdate(f"u{i}", "j", "s", f"h{i}", f"h{i}", "h0", 20 * MB, 1.0, 0, 0.001 * (i % 3))
            for i in range(1, 64)
        ]
        policy = TreePolicy()
        return policy.decide(Snapshot(0.001, g, in_flight=busy), ps), policy.decide(Snapshot(0.001, g), ps)

    native, python = both(decide)
    assert native == python


def test_instances_only_where_init_only_sets_the_fields() -> None:
    @dataclasses.dataclass(frozen=True)
    class Plain:
        a: int
        b: str = "x"

    @dataclasses.dataclass(frozen=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("negative")

    @dataclasses.dataclass
    class Own:
        a: int

        def __init__(self, a: int) -> None:
            self.a = a * 2

    assert records.init_fields(Plain) == ("a", "b")
    assert records.init_fields(Checked) is None and records.init_fields(Own) is None
    made = records.instances(Plain, [(1, "y"), (2, "z")])
    assert made == [Plain(1, "y"), Plain(2, "z")] and hash(made[0]) == hash(Plain(1, "y"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].a = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="negative"):
        records.instances(Checked, [(-1,)])  # its __init__ runs
    assert records.instances(Own, [(2,)])[0].a == 4


def in_flight_reservations(seed: int) -> object:
    """reserve_until of many overlapping transfers in flight, between walks: what each reserved."""
    rng = random.Random(seed)
    g = two_tier(3, 4, {f"h{i}": rng.choice([1e9, 2.5e9, 10e9]) for i in range(12)}, oversubscription=4)
    pc = PathCache(g)
    tls = Timelines(g, start=0.0)
    hosts = [f"h{i}" for i in range(12)]
    out: list[object] = []
    for k in range(60):
        a, b = rng.sample(hosts, 2)
        links = pc.links(a, b) if rng.random() < 0.95 else ()
        start = rng.choice([0.0, rng.random() * 0.01])
        end = rng.choice([start, start + rng.random() * 0.02, rng.random() * 0.01])
        out.append(tls.reserve_until(links, start, end, who=rng.choice(["", f"f{k}"])))
        if rng.random() < 0.3:
            out.append(tls.transfer(f"p{k}", pc.path(b, a), rng.choice([1, 5]) * MB, rng.random() * 0.01))
    return out, state(tls)


@pytest.mark.parametrize("seed", range(20))
def test_reservations_in_flight_are_the_python_ones(seed: int) -> None:
    native, python = both(lambda: in_flight_reservations(seed))
    assert native == python
    assert "Reservation(" in native


def test_reservations_in_flight_with_int_times_run_the_python_loop() -> None:
    g = nx.DiGraph()
    g.add_edge("a", "b", capacity=4.0)

    def run() -> object:
        tls = Timelines(g, start=0)
        return tls.reserve_until([("a", "b")], 0, 2), state(tls)

    native, python = both(run)
    assert native == python


def test_the_native_api_list_names_every_function_the_code_calls() -> None:
    """``native.NATIVE_API`` (checked at import: a stale build is named) covers every call."""
    import re
    from pathlib import Path

    from mlfabric.scheduler.core import native

    root = Path(native.__file__).resolve().parents[2]
    called = {
        name
        for folder in ("scheduler", "mlfabric", "daemon")
        for path in (root / folder).rglob("*.py")
        for name in re.findall(r"_plan_native\.([a-z_]+)\(", path.read_text())
    }
    assert called and called <= set(native.NATIVE_API), called - set(native.NATIVE_API)
    if native._plan_native is not None:
        assert native._stale(native._plan_native) == []
