"""The instance format: loading, validation messages that name the field, the generator."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mlfabric.scheduler.plan.instance import InstanceError, load_instance, parse_instance, two_tier_instance

EXAMPLE = Path(__file__).resolve().parents[2] / "experiments" / "instances" / "example.json"


def _valid() -> dict:
    return {
        "topology": {
            "hosts": ["s0", "w1", "w2", "a1"],
            "switches": ["sw"],
            "links": [{"a": h, "b": "sw", "gbps": 1.0} for h in ("s0", "w1", "w2", "a1")],
        },
        "server": "s0",
        "aggregators": ["a1"],
        "slot_seconds": 0.01,
        "objective": "makespan",
        "updates": [
            {"id": "u1", "worker": "w1", "bytes": 4000000, "ready_at": 0.0},
            {"id": "u2", "worker": "w2", "bytes": 2000000},
        ],
    }


def test_valid_instance_round_trips_every_field() -> None:
    inst = parse_instance(_valid())
    assert inst.server == "s0"
    assert inst.aggregators == ("a1",)
    assert inst.objective == "makespan"
    assert inst.slot_seconds == 0.01
    assert [(u.update_id, u.src, u.dst, u.bytes, u.ready_at) for u in inst.updates] == [
        ("u1", "w1", "s0", 4e6, 0.0),
        ("u2", "w2", "s0", 2e6, 0.0),
    ]
    assert inst.routes("u1") == (None, "a1")
    # links are full duplex at the given rate each way
    assert inst.capacity(("w1", "sw")) == inst.capacity(("sw", "w1")) == 1e9 / 8


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (lambda d: d["updates"][1].update(bytes=-5), "updates[1].bytes: must be a positive integer"),
        (lambda d: d["updates"][1].update(bytes=2.5), "updates[1].bytes: must be a positive integer"),
        (lambda d: d["updates"][0].update(worker="nope"), "updates[0].worker: 'nope' is not a host"),
        (lambda d: d["updates"][0].update(worker="s0"), "updates[0].worker: 's0' is the server itself"),
        (lambda d: d["updates"][1].update(id="u1"), "updates[1].id: 'u1' is used twice"),
        (lambda d: d["updates"][1].update(ready_at=-1), "updates[1].ready_at: must be a number >= 0"),
        (lambda d: d["updates"][1].update(colour="red"), "updates[1]: unknown field(s) colour"),
        (lambda d: d.update(server="sw"), "server: 'sw' is not a host"),
        (lambda d: d.update(aggregators=["x"]), "aggregators[0]: 'x' is not a host"),
        (lambda d: d.update(objective="fastest"), "objective: must be one of"),
        (lambda d: d.update(slot_seconds=0), "slot_seconds: must be a positive number"),
        (lambda d: d.update(updates=[]), "updates: must be a non-empty list"),
        (lambda d: d.pop("server"), "server: missing"),
        (lambda d: d["topology"]["links"][0].update(gbps=-1), "topology: links[0]"),
    ],
)
def test_errors_name_the_bad_field(patch, message: str) -> None:
    data = _valid()
    patch(data)
    with pytest.raises(InstanceError) as exc:
        parse_instance(data)
    assert message in str(exc.value)


def test_topology_path_is_relative_to_the_instance_file(tmp_path: Path) -> None:
    (tmp_path / "net.toml").write_text(
        'hosts = ["s0", "w1"]\n[[links]]\na = "w1"\nb = "s0"\nmbps = 8\nmbps_ba = 16\n'
    )
    data = _valid() | {"topology": "net.toml", "aggregators": []}
    data["updates"] = [{"id": "u", "worker": "w1", "bytes": 10}]
    (tmp_path / "inst.json").write_text(json.dumps(data))
    inst = load_instance(tmp_path / "inst.json")
    assert inst.capacity(("w1", "s0")) == 1e6
    assert inst.capacity(("s0", "w1")) == 2e6  # marked otherwise with mbps_ba


def test_load_errors_start_with_the_file_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InstanceError, match=r"bad\.json: not valid JSON"):
        load_instance(bad)
    data = _valid() | {"topology": "missing.toml"}
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(InstanceError, match=r"m\.json: topology: .*missing\.toml"):
        load_instance(tmp_path / "m.json")


def test_default_slot_is_a_quarter_of_the_median_update_on_the_server_ingress() -> None:
    data = _valid()
    del data["slot_seconds"]
    inst = parse_instance(data)
    # median of 4 MB and 2 MB = 3 MB over 125 MB/s = 24 ms; a quarter is 6 ms
    assert inst.slot_seconds == pytest.approx(0.006)


def test_shipped_example_loads() -> None:
    inst = load_instance(EXAMPLE)
    assert len(inst.updates) == 6 and inst.aggregators == ("a0", "a1")


def test_two_tier_generator_is_seeded_and_slot_aligned() -> None:
    a = two_tier_instance(random.Random(3), 8, 2)
    assert a == two_tier_instance(random.Random(3), 8, 2)
    inst = parse_instance(a)
    per_slot = 10e9 / 8 * inst.slot_seconds
    for u in inst.updates:
        assert (u.bytes / per_slot).is_integer()
        assert round(u.ready_at / inst.slot_seconds, 9).is_integer()
    assert inst.path("w0", "s0") == ("w0", "tor0", "core", "tor_s", "s0")
