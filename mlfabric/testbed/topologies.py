"""Topology tables for testbed experiments, and writing them as the TOML the scheduler reads.

The testbed and the scheduler must see the same bandwidth graph, so experiments build a
topology table here, write it with :func:`to_toml` and give the file to both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["bottleneck_star", "to_toml", "two_tier"]


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as a TOML value")


def to_toml(topology: Mapping[str, Any]) -> str:
    """Write a topology table (``hosts``, ``switches``, ``links``) as TOML.

    Examples
    --------
    >>> print(to_toml({"hosts": ["a", "b"], "links": [{"a": "a", "b": "b", "mbps": 10}]}))
    hosts = ["a", "b"]
    <BLANKLINE>
    [[links]]
    a = "a"
    b = "b"
    mbps = 10
    <BLANKLINE>
    """
    lines = [f"{k} = {_value(v)}" for k, v in topology.items() if k != "links"]
    for link in topology.get("links", []):
        lines += ["", "[[links]]", *(f"{k} = {_value(v)}" for k, v in link.items())]
    return "\n".join(lines) + "\n"


def bottleneck_star(server: str, server_mbps: float, workers: Mapping[str, float]) -> dict[str, Any]:
    """One switch; the server's link is the bottleneck, workers have their own uplink rates.

    Parameters
    ----------
    server : str
    server_mbps : float
        The server's link rate, each way (its ingress is the shared bottleneck).
    workers : mapping
        Worker host -> uplink rate in Mbit/s (heterogeneous uplinks).

    Examples
    --------
    >>> t = bottleneck_star("ps", 100, {"w0": 200, "w1": 50})
    >>> t["hosts"], t["links"][2]
    (['ps', 'w0', 'w1'], {'a': 'w1', 'b': 'tor', 'mbps': 50})
    """
    links = [{"a": server, "b": "tor", "mbps": server_mbps}]
    links += [{"a": w, "b": "tor", "mbps": rate} for w, rate in workers.items()]
    return {"hosts": [server, *workers], "switches": ["tor"], "links": links}


def two_tier(racks: Sequence[Mapping[str, float]], uplink_mbps: Sequence[float]) -> dict[str, Any]:
    """Racks of hosts under top-of-rack switches, joined by a core switch.

    Parameters
    ----------
    racks : sequence of mapping
        Per rack: host -> NIC rate, Mbit/s.
    uplink_mbps : sequence of float
        Per rack: the ToR-to-core rate, Mbit/s.

    Examples
    --------
    >>> t = two_tier([{"a": 100}, {"b": 50}], [200, 30])
    >>> t["switches"], t["links"][-1]
    (['core', 'tor0', 'tor1'], {'a': 'tor1', 'b': 'core', 'mbps': 30})
    """
    if len(racks) != len(uplink_mbps):
        raise ValueError("one uplink rate per rack")
    hosts = [h for rack in racks for h in rack]
    links = [
        {"a": h, "b": f"tor{i}", "mbps": rate} for i, rack in enumerate(racks) for h, rate in rack.items()
    ]
    links += [{"a": f"tor{i}", "b": "core", "mbps": rate} for i, rate in enumerate(uplink_mbps)]
    return {"hosts": hosts, "switches": ["core", *(f"tor{i}" for i in range(len(racks)))], "links": links}
