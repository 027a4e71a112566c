"""Max-min fair sharing by progressive filling, and the fluid network through time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.scheduler.sim.fluid import FluidNetwork, max_min_rates, water_fill


def test_three_flows_two_links_hand_worked() -> None:
    # b (4) is the first bottleneck: f2 and f3 get 2 each; a (10) gives f1 the 8 left.
    rates = max_min_rates({"f1": ["a"], "f2": ["a", "b"], "f3": ["b"]}, {"a": 10.0, "b": 4.0})
    assert rates == {"f1": 8.0, "f2": 2.0, "f3": 2.0}


def test_parking_lot_hand_worked() -> None:
    # A long flow over links 1..3 (capacity 6 each) and one short flow per link:
    # every link carries 2 flows -> 3 each.
    flows = {"long": ["l1", "l2", "l3"], "s1": ["l1"], "s2": ["l2"], "s3": ["l3"]}
    rates = max_min_rates(flows, dict.fromkeys(["l1", "l2", "l3"], 6.0))
    assert rates == {"long": 3.0, "s1": 3.0, "s2": 3.0, "s3": 3.0}
    # shrink l2 to 2: long and s2 get 1; s1 and s3 take the 5 left on their links.
    rates = max_min_rates(flows, {"l1": 6.0, "l2": 2.0, "l3": 6.0})
    assert rates == {"long": 1.0, "s1": 5.0, "s2": 1.0, "s3": 5.0}


def test_link_down_and_unconstrained_flow() -> None:
    rates = max_min_rates({"f": ["down", "up"], "g": ["up"], "local": []}, {"down": 0.0, "up": 3.0})
    assert rates == {"f": 0.0, "g": 3.0, "local": math.inf}


@st.composite
def _instances(draw: st.DrawFn) -> tuple[dict[int, list[int]], dict[int, float]]:
    n_links = draw(st.integers(1, 6))
    caps = {i: float(draw(st.integers(0, 20))) for i in range(n_links)}
    n_flows = draw(st.integers(1, 8))
    flows = {
        f: sorted(draw(st.sets(st.integers(0, n_links - 1), min_size=1, max_size=n_links)))
        for f in range(n_flows)
    }
    return flows, caps


@settings(max_examples=150, deadline=None)
@given(_instances())
def test_progressive_filling_is_max_min_fair(inst: tuple[dict[int, list[int]], dict[int, float]]) -> None:
    flows, caps = inst
    rates = max_min_rates(flows, caps)
    load = dict.fromkeys(caps, 0.0)
    for f, links in flows.items():
        for link in links:
            load[link] += rates[f]
    for link, c in caps.items():
        assert load[link] <= c + 1e-9, f"link {link} over capacity"
    # Max-min characterization: every flow has a bottleneck link that is full and on
    # which no flow has a larger rate.
    for f, links in flows.items():
        assert any(
            load[link] >= caps[link] - 1e-9
            and all(rates[g] <= rates[f] + 1e-9 for g, gl in flows.items() if link in gl)
            for link in links
        ), f"flow {f} has no bottleneck"
    # the vectorized filling agrees with the reference
    flow_of = np.array([f for f, links in flows.items() for _ in links])
    link_of = np.array([link for links in flows.values() for link in links])
    vec = water_fill(np.array([caps[i] for i in range(len(caps))]), flow_of, link_of, len(flows))
    assert np.allclose(vec, [rates[f] for f in range(len(flows))])


def test_n_equal_flows_finish_together_at_n_times_t() -> None:
    n, size, cap = 5, 10.0, 2.0  # alone: T = 5 s
    net: FluidNetwork[str, int] = FluidNetwork({"bottleneck": cap})
    for i in range(n):
        net.add(i, ["bottleneck"], size)
    assert net.rate(0) == pytest.approx(cap / n)
    t = net.next_completion()
    assert t == pytest.approx(n * size / cap)
    assert net.advance_to(t) == list(range(n))
    assert len(net) == 0 and net.next_completion() == math.inf


def test_departure_speeds_up_the_rest() -> None:
    net: FluidNetwork[str, str] = FluidNetwork({"l": 2.0})
    net.add("short", ["l"], 2.0)
    net.add("long", ["l"], 6.0)
    assert net.next_completion() == pytest.approx(2.0)  # each at 1 B/s
    assert net.advance_to(2.0) == ["short"]
    # 4 bytes left at 2 B/s
    assert net.remaining("long") == pytest.approx(4.0)
    assert net.next_completion() == pytest.approx(4.0)


def test_bandwidth_change_mid_transfer() -> None:
    net: FluidNetwork[str, str] = FluidNetwork({"l": 1.0})
    net.add("u", ["l"], 10.0)
    assert net.next_completion() == pytest.approx(10.0)
    assert net.advance_to(4.0) == []
    net.set_capacity("l", 3.0)  # 6 bytes left at 3 B/s
    assert net.next_completion() == pytest.approx(6.0)
    net.advance_to(5.0)
    net.set_capacity("l", 0.0)  # link down: never ends
    assert net.next_completion() == math.inf
    net.advance_to(9.0)
    net.set_capacity("l", 1.5)  # 3 bytes left
    assert net.next_completion() == pytest.approx(11.0)


def test_rate_changes_are_reported_and_time_cannot_go_back() -> None:
    seen: list[tuple[str, float, float]] = []
    net: FluidNetwork[str, str] = FluidNetwork(
        {"a": 4.0, "b": 1.0}, on_rate=lambda f, t, r: seen.append((f, t, r))
    )
    net.add("x", ["a"], 8.0)
    net.add("y", ["a", "b"], 1.0)
    net.next_completion()
    assert sorted(seen) == [("x", 0.0, 3.0), ("y", 0.0, 1.0)]
    net.advance_to(1.0)  # y is done; x alone gets all of a
    net.next_completion()
    assert seen[-1] == ("x", 1.0, 4.0)
    with pytest.raises(ValueError, match="back in time"):
        net.advance_to(0.5)
    with pytest.raises(KeyError, match="not in the network"):
        net.add("z", ["c"], 1.0)


def test_many_flows_grow_the_slots() -> None:
    net: FluidNetwork[str, int] = FluidNetwork({"l": 100.0})
    for i in range(200):
        net.add(i, ["l"], 1.0 + i)
    assert net.rate(199) == pytest.approx(0.5)
    assert net.remove(7) == pytest.approx(8.0)
    assert len(net) == 199
