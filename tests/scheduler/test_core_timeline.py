"""Link timelines and ten(g) on hand-worked examples (paper §5, Fig. 4)."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest

from mlfabric.scheduler.core.timeline import LinkTimeline, Timelines

MB = 1e6


def line(*caps: float) -> tuple[nx.DiGraph, list[tuple[str, str]]]:
    g = nx.DiGraph()
    nodes = [f"n{i}" for i in range(len(caps) + 1)]
    for (a, b), cap in zip(itertools.pairwise(nodes), caps, strict=True):
        g.add_edge(a, b, capacity=cap)
    return g, list(itertools.pairwise(nodes))


def test_fig4_thirty_mb_update_ends_at_seven() -> None:
    # Fig. 4b: residual 2, 5, 3, 10 MB/s for two seconds each: 4 + 10 + 6 = 20 MB by t=6,
    # the last 10 MB at 10 MB/s take one second more.
    g, links = line(10 * MB)
    profile = [(0.0, 2 * MB), (2.0, 5 * MB), (4.0, 3 * MB), (6.0, 10 * MB)]
    tls = Timelines(g, profiles={links[0]: profile})
    assert tls.ten(links, 30 * MB, ready=0.0) == (0.0, pytest.approx(7.0))
    start, end, res = tls.reserve(links, 30 * MB, ready=0.0, who="g")
    assert (start, end) == (0.0, pytest.approx(7.0))
    assert sum(r.rate * (r.end - r.start) for r in res) == pytest.approx(30 * MB)
    # Fig. 4c: g took all of it until t=7; afterwards the profile is untouched.
    tl = tls.link(links[0])
    assert [tl.at(t) for t in (0.5, 3.0, 5.0, 6.5, 7.5)] == [0.0, 0.0, 0.0, 0.0, 10 * MB]
    # the next update waits until t=7 and then gets the full 10 MB/s
    assert tls.ten(links, 10 * MB, ready=0.0) == (pytest.approx(7.0), pytest.approx(8.0))


def test_path_residual_is_the_minimum_and_partial_rates_leave_room() -> None:
    g, links = line(10.0, 4.0, 10.0)
    tls = Timelines(g)
    assert tls.residual(links, 0.0) == 4.0
    _, end, res = tls.reserve(links, 8.0, ready=1.0)
    assert end == pytest.approx(3.0)
    assert {r.link: r.rate for r in res} == dict.fromkeys(links, 4.0)
    # the first link keeps 6 B/s over [1, 3): a transfer on it alone runs alongside
    assert tls.ten(links[:1], 12.0, ready=1.0) == (1.0, pytest.approx(3.0))
    # a transfer over the middle link must wait for it
    assert tls.ten(links[1:2], 8.0, ready=0.0) == (0.0, pytest.approx(4.0))  # 4 B by t=1, 4 B after t=3


def test_ready_time_and_gaps() -> None:
    g, links = line(2.0)
    tls = Timelines(g)
    tls.reserve(links, 2.0, ready=1.0)  # busy [1, 2)
    assert tls.ten(links, 4.0, ready=0.0) == (0.0, pytest.approx(3.0))  # 2 B before, pause, 2 B after
    assert tls.ten(links, 1.0, ready=5.0) == (5.0, 5.5)


def test_reserve_until_takes_whole_residual_and_overreservation_is_refused() -> None:
    g, links = line(4.0, 2.0)
    tls = Timelines(g)
    res = tls.reserve_until(links, 0.0, 3.0, who="in-flight")
    assert {(r.link, r.rate) for r in res} == {(links[0], 2.0), (links[1], 2.0)}
    assert tls.link(links[0]).at(1.0) == 2.0
    with pytest.raises(ValueError, match="reserving 3 B/s for x at t=0 exceeds the residual 2 B/s"):
        tls.link(links[0]).reserve(0.0, 1.0, 3.0, who="x")


def test_link_timeline_coalesces_and_copies() -> None:
    tl = LinkTimeline(10.0)
    tl.reserve(0.0, 1.0, 5.0)
    tl.reserve(1.0, 2.0, 5.0)
    assert tl.pieces() == [(0.0, 2.0, 5.0), (2.0, float("inf"), 10.0)]
    other = tl.copy()
    other.reserve(0.0, 2.0, 5.0)
    assert tl.at(1.0) == 5.0 and other.at(1.0) == 0.0


def test_path_that_never_frees_raises() -> None:
    g, links = line(1.0)
    tls = Timelines(g, profiles={links[0]: [(0.0, 1.0), (1.0, 0.0)]})
    with pytest.raises(ValueError, match="never has residual bandwidth"):
        tls.ten(links, 5.0, ready=0.0)


def test_no_links_is_instant() -> None:
    g, _ = line(1.0)
    assert Timelines(g).ten([], 100.0, ready=2.0) == (2.0, 2.0)


def _dense(reservations: list[tuple[float, float, float]], cap: float, t: float) -> float:
    return cap - sum(rate for lo, hi, rate in reservations if lo <= t < hi)


def test_reservations_match_a_dense_model_with_no_equal_neighbours() -> None:
    # LinkTimeline.reserve has a short path for reservations from its last breakpoint on
    # (most of the planners'): on random reservations, in and out of order, the timeline
    # reads as capacity minus the reservations covering each instant, with no breakpoint
    # between two equal residuals
    import random

    rng = random.Random(5)
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0]
    for _ in range(400):
        tl, cap = LinkTimeline(8.0), 8.0
        done: list[tuple[float, float, float]] = []
        for _ in range(rng.randint(1, 10)):
            lo = rng.choice(grid)
            hi = lo + rng.choice([0.5, 1.0, 2.0])
            rate = rng.choice([1.0, 2.0, 4.0, 8.0])
            if min(_dense(done, cap, t) for t in [*grid, lo] if lo <= t < hi) < rate:
                with pytest.raises(ValueError, match="exceeds the residual"):
                    tl.reserve(lo, hi, rate, who="x")
                break
            tl.reserve(lo, hi, rate)
            done.append((lo, hi, rate))
            assert all(tl.at(t) == _dense(done, cap, t) for t in [*grid, *(t + 0.25 for t in grid)])
            assert all(a != b for a, b in itertools.pairwise(tl.residual))


def test_a_path_waits_for_its_one_busy_link() -> None:
    g, links = line(4.0, 2.0)
    tls = Timelines(g)
    tls.reserve(links[1:], 4.0, ready=0.0)  # the second link full over [0, 2)
    assert tls.rates(links, 4.0, ready=1.0) == (2.0, 4.0, [(2.0, 4.0, 2.0)])
    with pytest.raises(KeyError, match="no link"):
        tls.link(("n1", "n0"))
