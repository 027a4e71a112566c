"""experiments/testbed_racks.py: its topology, round split and summary (pure), and its link check (root)."""

from __future__ import annotations

import argparse
import doctest
import sys
from collections.abc import Callable
from pathlib import Path

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import parse_topology, two_tier
from mlfabric.testbed.cluster import Testbed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
try:
    import testbed_racks as racks
finally:
    sys.path.pop(0)


def test_docstring_examples() -> None:
    result = doctest.testmod(racks, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(("rate", "over"), [(100.0, 4.0), (1000.0, 4.0), (100.0, 2.0)])
def test_the_racks_are_two_tier_with_the_server_on_the_core(rate: float, over: float) -> None:
    g = parse_topology(racks.racks_topology(2, 4, rate, over))
    ref = two_tier(2, 4, rate * 1e6, oversubscription=over)  # hosts h0..h7 where we have w0..w7
    for r in range(2):
        for a, b in ((f"tor{r}", "core"), ("core", f"tor{r}")):
            assert g.edges[a, b]["capacity"] == pytest.approx(ref.edges[a, b]["capacity"])
    assert g.edges["w5", "tor1"]["capacity"] == pytest.approx(ref.edges["h5", "tor1"]["capacity"])
    assert g.edges["ps", "core"]["capacity"] == g.edges["core", "ps"]["capacity"] == rate * 1e6 / 8
    assert nx.shortest_path(g, "w0", "ps") == ["w0", "tor0", "core", "ps"]
    assert nx.shortest_path(g, "w3", "w4") == ["w3", "tor0", "core", "tor1", "w4"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        racks.racks_topology(2, 4, 100, 0)


def test_the_round_split_adds_up_and_ignores_skipped_versions() -> None:
    log = {
        "start": 0.0,
        "rows": [
            {"t": 0.0, "version": 1},
            {"t": 5.0, "version": 2},
            {"t": 9.0, "version": 4},  # two rounds in one record: left out
            {"t": 12.0, "version": 5},
        ],
    }
    transfers = [
        {"ok": True, "start": 1.0, "end": 4.0},
        {"ok": True, "start": 2.0, "end": 4.5},
        {"ok": True, "start": 6.0, "end": 8.0},
        {"ok": True, "start": 9.5, "end": 11.0},
    ]
    s = racks.round_split(log, transfers)
    assert s["rounds"] == 2
    assert (s["round"], s["lead"], s["transfer"], s["tail"], s["longest"]) == (4.0, 0.75, 2.5, 0.75, 5.0)


def test_the_summary_gives_ratios_against_fair_and_ddp() -> None:
    args = argparse.Namespace(
        quick=False,
        racks=2,
        per_rack=4,
        rate_mbps=100.0,
        oversubscription=4.0,
        lr=0.05,
        batch=64,
        compute=0.02,
        slowdown=1.0,
        target=0.95,
        seeds="0,1,2",
        systems="fair,stf+tree,ddp,ddp+hook",
        commit="abc",
    )
    times = {"fair": (90.0, 100.0, 120.0), "stf+tree": (50.0, 60.0, None), "ddp": (40.0, 30.0, 35.0)}
    times["ddp+hook"] = (20.0, 30.0, 35.0)
    rows = [
        {"seed": seed, "system": system, "time_to_target": t, "final_accuracy": 0.95, "load1": 2.0}
        for system, ts in times.items()
        for seed, t in enumerate(ts)
    ]
    text = racks.summary(rows, args, ["link check: x"])
    table = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| ")
    }
    assert table["fair"][3:7] == ["100.0", "90.0-120.0", "1.00x", "0.35x"]
    assert table["stf+tree"][1:7] == ["3", "2", "55.0", "50.0-60.0", "1.82x", "0.64x"]
    assert table["ddp+hook"][5:7] == ["3.33x", "1.17x"]
    assert "ddp / ddp+hook (> 1: the hook faster): median 1.00x; per seed 2.00, 1.00, 1.00" in text
    assert "rack uplinks 100 Mbit/s" in text and "- link check: x" in text


@pytest.mark.slow
@pytest.mark.root
def test_the_link_check_sees_the_shared_uplink(make_testbed: Callable[[nx.DiGraph], Testbed]) -> None:
    """Skipped without root, ``ip`` and ``tc`` (the ``make_testbed`` fixture says which is missing)."""
    graph = parse_topology(racks.racks_topology(2, 2, 50, 2))
    testbed = make_testbed(graph)
    one, across = racks.link_checks(testbed, graph, ["w0", "w1", "w2", "w3"], per_rack=2)
    assert one.startswith("link check: 5 concurrent flows at 50 Mbit/s")
    assert "(50 Mbit/s): 2 concurrent flows together" in across
