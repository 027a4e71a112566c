"""The fluid network's incremental max-min (only the changed links' components) equals a refill
from scratch, through arrivals, departures and capacity changes on random topologies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.scheduler.sim.fluid import FluidNetwork, max_min_rates

#: one step: ("add", flow, links, bytes) | ("remove", flow) | ("cap", link, capacity) | ("time", dt)
Step = tuple[object, ...]


def _check(net: FluidNetwork[int, int], flows: dict[int, list[int]], caps: dict[int, float]) -> None:
    """Every active flow's rate is the from-scratch max-min rate (and the refill saw a subset)."""
    want = max_min_rates(flows, caps)
    for f, r in want.items():
        got = net.rate(f)
        if math.isinf(r):
            assert math.isinf(got)
        else:
            assert got == pytest.approx(r, rel=1e-9, abs=1e-9), f"flow {f}"


def _replay(n_links: int, caps0: list[float], steps: list[Step]) -> FluidNetwork[int, int]:
    caps = dict(enumerate(caps0))
    net: FluidNetwork[int, int] = FluidNetwork(dict(caps))
    flows: dict[int, list[int]] = {}
    for step in steps:
        kind = step[0]
        if kind == "add":
            _, f, links, nbytes = step
            assert isinstance(f, int) and isinstance(links, list) and isinstance(nbytes, float)
            net.add(f, links, nbytes)
            flows[f] = links
        elif kind == "remove":
            f = step[1]
            assert isinstance(f, int)
            if f in net:
                net.remove(f)
            flows.pop(f, None)
        elif kind == "cap":
            _, link, c = step
            assert isinstance(link, int) and isinstance(c, float)
            net.set_capacity(link, c)
            caps[link] = c
        else:
            dt = step[1]
            assert isinstance(dt, float)
            t = min(net.now + dt, net.next_completion())
            for f in net.advance_to(t):
                flows.pop(f)
        _check(net, flows, caps)
    return net


@st.composite
def _scripts(draw: st.DrawFn) -> tuple[int, list[float], list[Step]]:
    n_links = draw(st.integers(2, 10))
    caps = [float(draw(st.integers(0, 12))) for _ in range(n_links)]
    steps: list[Step] = []
    live: list[int] = []
    for f in range(draw(st.integers(1, 30))):
        op = draw(st.sampled_from(["add", "add", "add", "remove", "cap", "time"]))
        if op == "add" or not live:
            links = sorted(draw(st.sets(st.integers(0, n_links - 1), min_size=0, max_size=3)))
            steps.append(("add", f, links, float(draw(st.integers(0, 20)))))
            live.append(f)
        elif op == "remove":
            steps.append(("remove", live.pop(draw(st.integers(0, len(live) - 1)))))
        elif op == "cap":
            steps.append(("cap", draw(st.integers(0, n_links - 1)), float(draw(st.integers(0, 12)))))
        else:
            steps.append(("time", draw(st.sampled_from([0.0, 0.5, 2.0, 100.0]))))
    return n_links, caps, steps


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_scripts())
def test_incremental_rates_equal_a_refill_from_scratch(script: tuple[int, list[float], list[Step]]) -> None:
    _replay(*script)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_disjoint_racks_refill_only_the_changed_rack(seed: int) -> None:
    # 20 racks, flows only inside a rack: each rack is a component. A change in some racks
    # recomputes the flows of those racks only, and every rate equals the reference.
    rng = np.random.default_rng(seed)
    racks, per = 20, 4
    caps = {(r, i): float(rng.integers(1, 10)) for r in range(racks) for i in range(per)}
    net: FluidNetwork[tuple[int, int], int] = FluidNetwork(caps)
    flows: dict[int, list[tuple[int, int]]] = {}
    for f in range(200):
        r = int(rng.integers(racks))
        size = int(rng.integers(1, per + 1))
        links = [(r, int(i)) for i in sorted(rng.choice(per, size=size, replace=False))]
        net.add(f, links, float(rng.integers(1, 50)))
        flows[f] = links
        touched = {r}
        if f % 3 == 2:
            gone = int(rng.choice(list(flows)))
            touched.add(flows[gone][0][0])
            net.remove(gone)
            del flows[gone]
        before = net.refilled_flows
        want = max_min_rates(flows, caps)
        for g in flows:
            assert net.rate(g) == pytest.approx(want[g], rel=1e-12)
        in_touched = sum(1 for links in flows.values() if links[0][0] in touched)
        assert net.refilled_flows - before <= in_touched


def test_components_split_after_departures() -> None:
    # a flow over a and b joins their components; once it ended (and enough flows after it),
    # a change on a no longer refills the flow on b.
    net: FluidNetwork[str, str] = FluidNetwork({"a": 4.0, "b": 6.0})
    net.add("bridge", ["a", "b"], 1.0)
    net.add("on_b", ["b"], 1e9)
    assert net.rate("on_b") == 3.0  # b split evenly
    net.remove("bridge")
    for i in range(200):  # departures enough to rebuild the components from the active flows
        net.add(f"t{i}", ["a"], 1.0)
        assert net.rate(f"t{i}") == 4.0
        net.remove(f"t{i}")
    assert net.rate("on_b") == 6.0
    before = net.refilled_flows
    net.add("x", ["a"], 1.0)
    assert net.rate("x") == 4.0 and net.rate("on_b") == 6.0
    assert net.refilled_flows - before == 1
