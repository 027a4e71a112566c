"""One bandwidth-schedule format and parser (core/bandwidth_schedule.py) for simulator and testbed."""

from __future__ import annotations

import tomllib
import warnings

import pytest

from mlfabric.scheduler.core.bandwidth_schedule import BandwidthChange, parse_bandwidth_schedule
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.sim import workload
from mlfabric.testbed.schedule import RateChange, parse_schedule

FILE = """
[[change]]
at = 2.5
a = "h1"
b = "sw"
mbps = 80

[[change]]
at = 1
a = "sw"
b = "h0"
gbps = 0
direction = "ab"
"""


def test_new_form_gives_directed_changes_sorted_by_time() -> None:
    changes = parse_bandwidth_schedule(tomllib.loads(FILE), star(2, 1e9))
    assert changes == [
        BandwidthChange(1.0, ("sw", "h0"), 0.0),
        BandwidthChange(2.5, ("h1", "sw"), 10e6),
        BandwidthChange(2.5, ("sw", "h1"), 10e6),
    ]


def test_simulator_and_testbed_read_the_same_file_the_same_way() -> None:
    data = tomllib.loads(FILE.replace("gbps = 0", "gbps = 1"))
    graph = star(2, 1e9)
    sim = workload.parse_bandwidth_schedule(data, graph)
    testbed = parse_schedule(data, graph)
    assert workload.parse_bandwidth_schedule is parse_bandwidth_schedule
    assert testbed == [RateChange(c.at, c.link, c.capacity, "forward") for c in sim]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"at": 1, "a": "h0", "b": "sw"}, r"change\[0\]: give exactly one of gbps or mbps"),
        ({"at": 1, "a": "h0", "b": "sw", "mbps": -1}, r"change\[0\]: rate must be a number >= 0"),
        ({"at": -1, "a": "h0", "b": "sw", "mbps": 1}, r"change\[0\]: 'at' must be a time >= 0"),
        ({"at": 1, "a": "h0", "b": "h1", "mbps": 1}, r"change\[0\]: no link h0-h1"),
        ({"at": 1, "a": "h0", "mbps": 1}, r"change\[0\]: 'a' and 'b' must name the link's ends"),
        ({"at": 1, "a": "h0", "b": "sw", "mbps": 1, "direction": "ba"}, r"direction must be 'both' or 'ab'"),
        ({"at": 1, "a": "h0", "b": "sw", "mbps": 1, "rate": 3}, r"change\[0\]: unknown field\(s\) rate"),
    ],
)
def test_bad_entries_are_named(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bandwidth_schedule({"change": [entry]}, star(2, 1e9))


@pytest.mark.parametrize(
    "old, new",
    [
        ({"link": ["h0", "sw"]}, {"a": "h0", "b": "sw"}),
        ({"link": ["h0", "sw"], "direction": "forward"}, {"a": "h0", "b": "sw", "direction": "ab"}),
        ({"link": ["h0", "sw"], "direction": "reverse"}, {"a": "sw", "b": "h0", "direction": "ab"}),
    ],
)
def test_old_testbed_form_reads_as_the_new_with_a_warning_naming_it(
    old: dict[str, object], new: dict[str, object]
) -> None:
    with pytest.warns(DeprecationWarning, match="is the old form; write a = ") as caught:
        got = parse_bandwidth_schedule({"change": [{"at": 1, "mbps": 8, **old}]})
    assert f'a = "{new["a"]}", b = "{new["b"]}"' in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert got == parse_bandwidth_schedule({"change": [{"at": 1, "mbps": 8, **new}]})
