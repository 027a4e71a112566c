"""The pure parts of the testbed: layout, tc arguments, prerequisites, stale sweep, schedules."""

from __future__ import annotations

import doctest
import ipaddress
import random
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from mlfabric.scheduler.core.graph import parse_topology, star
from mlfabric.testbed import cluster, linkcheck, netns, plan, probe, schedule, tc, topologies
from mlfabric.testbed.netns import (
    missing_prerequisites,
    new_prefix,
    stale_prefixes,
    sweep_stale,
    write_marker,
)
from mlfabric.testbed.plan import CONTROL_NET, DATA_NET, LayoutError, plan_layout
from mlfabric.testbed.schedule import (
    RateChange,
    ScheduleRunner,
    compute_delays,
    ns_schedule,
    parse_schedule,
)

PREFIX = "mlf0a1b2c"

TWO_TIER = {
    "hosts": ["ps", "w0", "w1", "w2"],
    "switches": ["core", "tor0", "tor1"],
    "links": [
        {"a": "ps", "b": "tor0", "mbps": 100},
        {"a": "w0", "b": "tor0", "mbps": 50, "mbps_ba": 20},
        {"a": "w1", "b": "tor1", "mbps": 50},
        {"a": "w2", "b": "tor1", "mbps": 10},
        {"a": "tor0", "b": "core", "mbps": 200},
        {"a": "tor1", "b": "core", "mbps": 30},
    ],
}


def test_layout_shapes_each_direction_on_its_senders_egress() -> None:
    g = parse_topology(TWO_TIER)
    layout = plan_layout(g, PREFIX)
    for (u, v), end in layout.link_ends.items():
        assert end.rate == g.edges[u, v]["capacity"]
        # the end carrying u -> v lives in u's namespace
        owner = layout.host_namespace.get(u) or next(n.name for n in layout.namespaces if n.node == u)
        assert end.namespace == owner
    assert layout.link_ends[("w0", "tor0")].rate == 50e6 / 8
    assert layout.link_ends[("tor0", "w0")].rate == 20e6 / 8  # w0's ingress
    assert len(layout.pairs) == 6 + 4  # a pair per link and a control pair per host


def test_layout_names_and_addresses_are_unique_and_in_range() -> None:
    layout = plan_layout(parse_topology(TWO_TIER), PREFIX)
    names = [ns.name for ns in layout.namespaces]
    assert len(set(names)) == len(names)
    assert all(n.startswith(PREFIX + "-") for n in names)
    addresses = list(layout.host_address.values()) + list(layout.host_control_address.values())
    assert len(set(addresses)) == len(addresses)
    assert all(ipaddress.ip_address(a) in DATA_NET for a in layout.host_address.values())
    assert all(ipaddress.ip_address(a) in CONTROL_NET for a in layout.host_control_address.values())
    assert layout.control_address not in addresses
    ifnames = {(e.namespace, e.ifname) for pair in layout.pairs for e in pair}
    assert len(ifnames) == 2 * len(layout.pairs)
    assert all(len(ifname) <= 15 for _, ifname in ifnames)


def test_layout_refuses_what_it_cannot_emulate() -> None:
    ring = {
        "hosts": ["a", "b"],
        "switches": ["s0", "s1"],
        "links": [
            {"a": "a", "b": "s0", "mbps": 1},
            {"a": "b", "b": "s1", "mbps": 1},
            {"a": "s0", "b": "s1", "mbps": 1},
            {"a": "s1", "b": "s0", "mbps": 1},
        ],
    }
    with pytest.raises(Exception, match="duplicate"):
        parse_topology(ring)
    cycle = {
        "hosts": ["a"],
        "switches": ["s0", "s1", "s2"],
        "links": [
            {"a": "a", "b": "s0", "mbps": 1},
            {"a": "s0", "b": "s1", "mbps": 1},
            {"a": "s1", "b": "s2", "mbps": 1},
            {"a": "s2", "b": "s0", "mbps": 1},
        ],
    }
    with pytest.raises(LayoutError, match="cycle"):
        plan_layout(parse_topology(cycle), PREFIX)
    two_nics = {
        "hosts": ["a", "b"],
        "switches": ["s0", "s1"],
        "links": [
            {"a": "a", "b": "s0", "mbps": 1},
            {"a": "a", "b": "s1", "mbps": 1},
            {"a": "b", "b": "s1", "mbps": 1},
        ],
    }
    with pytest.raises(LayoutError, match="host 'a' has 2 links"):
        plan_layout(parse_topology(two_nics), PREFIX)
    with pytest.raises(LayoutError, match="prefix"):
        plan_layout(star(2, 1e6), "other-1")


def test_tbf_burst_covers_a_tick_and_a_gso_packet() -> None:
    for bits in (1e6, 50e6, 1e9, 10e9, 40e9):
        rate = bits / 8
        burst = tc.tbf_burst(rate)
        assert burst >= rate / tc.TIMER_HZ
        assert burst > 64 * 1024 + 100  # a whole GSO packet with its headers fits
    args = tc.tbf_args("p3", 1e9 / 8, change=True)
    assert args[:4] == ["qdisc", "change", "dev", "p3"]
    assert args[args.index("rate") + 1] == "1000000000bit"
    assert int(args[args.index("limit") + 1]) > int(args[args.index("burst") + 1])
    with pytest.raises(ValueError):
        tc.tbf_burst(0)


def test_missing_prerequisites_names_each_missing_piece() -> None:
    assert missing_prerequisites(which=lambda name: f"/sbin/{name}", euid=0) == []
    missing = missing_prerequisites(which=lambda name: None if name == "tc" else "/sbin/ip", euid=0)
    assert missing == ["no 'tc' command (iproute2) on PATH"]
    assert "not root" in missing_prerequisites(which=lambda name: "/x", euid=1000)[0]


class FakeRunner:
    """Records commands; answers `ip netns list` with a fixed list."""

    def __init__(self, namespaces: Sequence[str]) -> None:
        self.namespaces = list(namespaces)
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], *, check: bool = True) -> str:
        self.calls.append(list(argv))
        if list(argv) == ["ip", "netns", "list"]:
            return "".join(f"{n} (id: {i})\n" for i, n in enumerate(self.namespaces))
        return ""


def test_sweep_deletes_only_dead_runs_with_our_pattern(tmp_path: Path) -> None:
    live, dead, orphan, persistent = "mlf00000a", "mlf00000b", "mlf00000c", "mlf00000d"
    namespaces = [
        f"{live}-h0-ps",
        f"{dead}-h0-ps",
        f"{dead}-ctl",
        f"{orphan}-s0-tor",
        f"{persistent}-ctl",
        "mlfabric-other",
        "mlf00000e",  # no "-": not ours
        "somebody-elses",
    ]
    write_marker(tmp_path, live, {"pid": 1})  # pid 1 is alive
    write_marker(tmp_path, dead, {"pid": 2**22 + 12345})
    write_marker(tmp_path, persistent, {"pid": 2**22 + 12345, "persistent": True})
    runner = FakeRunner(namespaces)
    deleted = sweep_stale(runner, tmp_path)
    assert sorted(deleted) == sorted([f"{dead}-h0-ps", f"{dead}-ctl", f"{orphan}-s0-tor"])
    deleted_by_command = [c[-1] for c in runner.calls if c[:3] == ["ip", "netns", "del"]]
    assert sorted(deleted_by_command) == sorted(deleted)
    assert not (tmp_path / f"{dead}.json").exists()
    assert (tmp_path / f"{live}.json").exists()


def test_stale_prefixes_and_new_prefix() -> None:
    assert stale_prefixes(["mlf123456-ctl"], {"mlf123456": {"pid": 7}}, alive=lambda pid: False) == {
        "mlf123456"
    }
    assert stale_prefixes(["mlf123456-ctl"], {"mlf123456": {"pid": 7}}, alive=lambda pid: True) == set()
    rng = random.Random(5)
    prefixes = {new_prefix(rng) for _ in range(50)}
    assert len(prefixes) == 50
    assert all(len(p) == 9 and p.startswith("mlf") for p in prefixes)


def test_parse_schedule_reads_the_one_bandwidth_schedule_format() -> None:
    g = star(["a", "b"], 8e6)
    changes = parse_schedule(
        {
            "change": [
                {"at": 3, "a": "a", "b": "sw", "gbps": 1, "direction": "ab"},
                {"at": 1, "a": "sw", "b": "b", "mbps": 4},
            ]
        },
        g,
    )
    assert [(c.at, c.link) for c in changes] == [(1.0, ("sw", "b")), (1.0, ("b", "sw")), (3.0, ("a", "sw"))]
    assert changes[2] == RateChange(3.0, ("a", "sw"), 1e9 / 8, "forward")
    for bad in (
        {"at": 1, "a": "a", "b": "b", "mbps": 1},
        {"at": 1, "a": "a", "b": "sw"},
        {"at": -1, "a": "a", "b": "sw", "mbps": 1},
        {"at": 1, "a": "a", "b": "sw", "mbps": 1, "direction": "up"},
        {"at": 1, "a": "a", "b": "sw", "mbps": 0},
    ):
        with pytest.raises(ValueError):
            parse_schedule({"change": [bad]}, g)


def test_parse_schedule_reads_the_old_testbed_form_with_a_deprecation_warning() -> None:
    g = star(["a", "b"], 8e6)
    old = {"at": 3, "link": ["a", "sw"], "gbps": 1, "direction": "reverse"}
    with pytest.warns(DeprecationWarning, match='write a = "sw", b = "a", direction = "ab" instead'):
        changes = parse_schedule({"change": [old]}, g)
    assert changes == [RateChange(3.0, ("sw", "a"), 1e9 / 8, "forward")]
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="no link a-b"):
        parse_schedule({"change": [{"at": 1, "link": ["a", "b"], "mbps": 1}]}, g)


def test_ns_schedule_and_compute_delays_are_seeded() -> None:
    g = star(["a", "b", "c"], 80e6)
    links = [("a", "sw"), ("b", "sw")]
    one = ns_schedule(g, links, levels=(1.0, 0.5, 0.25), period=5, duration=30, rng=random.Random(3))
    two = ns_schedule(g, links, levels=(1.0, 0.5, 0.25), period=5, duration=30, rng=random.Random(3))
    assert one == two
    assert len(one) == 5 * len(links)
    assert {c.rate for c in one} <= {10e6, 5e6, 2.5e6}
    delays = compute_delays(
        ["w0", "w1", "w2", "w3"], base=0.2, stragglers=2, slowdown=4, rng=random.Random(1)
    )
    assert sorted(delays.values()) == [0.2, 0.2, 0.8, 0.8]


def test_schedule_runner_applies_in_order_and_stops() -> None:
    applied: list[RateChange] = []
    changes = [
        RateChange(0.05, ("a", "b"), 2.0),
        RateChange(0.0, ("a", "b"), 1.0),
        RateChange(60, ("a", "b"), 3.0),
    ]
    runner = ScheduleRunner(applied.append, changes)
    runner.start()
    deadline = time.monotonic() + 5
    while len(applied) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    runner.stop()
    assert [c.rate for c in applied] == [1.0, 2.0]
    assert runner.applied[1][0] >= 0.05
    assert runner.error is None


@pytest.mark.parametrize("module", [cluster, linkcheck, netns, plan, probe, schedule, tc, topologies])
def test_docstring_examples(module: object) -> None:
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert failures == 0


def test_topology_tables_round_trip_through_toml(tmp_path: Path) -> None:
    from mlfabric.scheduler.core.graph import load_topology

    table = topologies.two_tier([{"ps": 100, "w0": 50}, {"w1": 20}], uplink_mbps=[200, 30])
    path = tmp_path / "t.toml"
    path.write_text(topologies.to_toml(table))
    g = load_topology(path)
    assert g.edges["w1", "tor1"]["capacity"] == 20e6 / 8
    assert g.edges["tor1", "core"]["capacity"] == 30e6 / 8
    checks = {c.link: c for c in linkcheck.plan_link_checks(g)}
    assert len(checks) == g.number_of_edges()
    # the tor1 -> core direction is crossed by w1's transfers; its best path is 20 Mbit/s
    assert checks[("tor1", "core")].src == "w1"
    assert checks[("tor1", "core")].expected == 20e6 / 8
