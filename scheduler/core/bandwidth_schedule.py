"""Bandwidth schedules: link capacities that change over time (DESIGN §6, paper §7 NS1-NS3).

One file format, read by one parser, for the simulator (``mlfabric simulate
--bandwidth-schedule F``) and the emulated testbed (:mod:`mlfabric.testbed.schedule`). A
schedule file is TOML with one ``[[change]]`` table per change::

    [[change]]
    at = 2.0          # seconds after the start
    a = "h3"          # the link's ends
    b = "sw"
    mbps = 100        # or gbps; 0 takes the link down (simulator only)
    direction = "both"  # "both" (default) or "ab" (only a -> b)

:func:`parse_bandwidth_schedule` turns the parsed table into :class:`BandwidthChange` steps
of directed links, sorted by time. The testbed's former form (``link = ["a", "b"]`` and
``direction`` ``"forward"``, ``"reverse"`` or ``"both"``) is still read, with a
:class:`DeprecationWarning` naming the form above.

Pure: no I/O (the callers read the file and pass the parsed TOML).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx

from mlfabric.scheduler.core.graph import BITS_PER_BYTE

__all__ = ["BandwidthChange", "parse_bandwidth_schedule"]

_FIELDS = frozenset({"at", "a", "b", "gbps", "mbps", "direction"})
_OLD_FIELDS = frozenset({"at", "link", "gbps", "mbps", "direction"})


@dataclass(frozen=True, order=True)
class BandwidthChange:
    """From time ``at`` on, directed link ``link`` has ``capacity`` bytes/s.

    Examples
    --------
    >>> BandwidthChange(2.0, ("h1", "sw"), 1.25e8).capacity
    125000000.0
    """

    at: float
    link: tuple[str, str]
    capacity: float


def _rate(entry: Mapping[str, Any], where: str) -> float:
    gbps, mbps = entry.get("gbps"), entry.get("mbps")
    if (gbps is None) == (mbps is None):
        raise ValueError(f"{where}: give exactly one of gbps or mbps")
    rate, scale = (gbps, 1e9) if gbps is not None else (mbps, 1e6)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or rate < 0:
        raise ValueError(f"{where}: rate must be a number >= 0")
    return float(rate) * scale / BITS_PER_BYTE


def _old_form(entry: Mapping[str, Any], where: str) -> tuple[str, str, str]:
    """Ends and direction of a change in the testbed's former form (``link``, forward/reverse/both)."""
    link = entry.get("link")
    if not (isinstance(link, list | tuple) and len(link) == 2 and all(isinstance(x, str) for x in link)):
        raise ValueError(f"{where}: link must be [a, b], got {link!r}")
    direction = entry.get("direction", "both")
    if direction not in ("forward", "reverse", "both"):
        raise ValueError(f"{where}: direction must be 'forward', 'reverse' or 'both', got {direction!r}")
    a, b = link
    if direction == "reverse":
        a, b = b, a
    warnings.warn(
        f'{where}: link = ["{link[0]}", "{link[1]}"] with direction {direction!r} is the old form; write '
        f'a = "{a}", b = "{b}"' + (', direction = "ab"' if direction != "both" else "") + " instead",
        DeprecationWarning,
        stacklevel=3,
    )
    return a, b, "both" if direction == "both" else "ab"


def parse_bandwidth_schedule(
    data: Mapping[str, Any], graph: nx.DiGraph | None = None
) -> list[BandwidthChange]:
    """Bandwidth changes from a parsed TOML schedule (the format of the module docstring).

    Parameters
    ----------
    data : mapping
        The parsed file: a list ``change`` of tables.
    graph : networkx.DiGraph, optional
        When given, every link must be one of its links.

    Returns
    -------
    list of BandwidthChange
        One per directed link (two for ``direction = "both"``), sorted by time (stable for
        equal times).

    Raises
    ------
    ValueError
        Naming the offending entry and field.

    Examples
    --------
    >>> ch = parse_bandwidth_schedule({"change": [{"at": 1, "a": "h0", "b": "sw", "gbps": 8}]})
    >>> [(c.at, c.link, c.capacity) for c in ch]
    [(1.0, ('h0', 'sw'), 1000000000.0), (1.0, ('sw', 'h0'), 1000000000.0)]
    >>> parse_bandwidth_schedule({"change": [{"at": 0, "a": "h0", "b": "sw", "mbps": 8, "direction": "ab"}]})
    [BandwidthChange(at=0.0, link=('h0', 'sw'), capacity=1000000.0)]
    """
    entries = data.get("change", [])
    if not isinstance(entries, list):
        raise ValueError("'change' must be a list of tables")
    out: list[BandwidthChange] = []
    for i, entry in enumerate(entries):
        where = f"change[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected a table")
        allowed = _OLD_FIELDS if "link" in entry else _FIELDS
        extra = set(entry) - allowed
        if extra:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
        at = entry.get("at")
        if isinstance(at, bool) or not isinstance(at, int | float) or at < 0:
            raise ValueError(f"{where}: 'at' must be a time >= 0 (s)")
        if "link" in entry:
            a, b, direction = _old_form(entry, where)
        else:
            ends = entry.get("a"), entry.get("b")
            if not all(isinstance(end, str) for end in ends):
                raise ValueError(
                    f"{where}: 'a' and 'b' must name the link's ends, got {ends[0]!r} and {ends[1]!r}"
                )
            a, b = str(ends[0]), str(ends[1])
            direction = entry.get("direction", "both")
            if direction not in ("both", "ab"):
                raise ValueError(f"{where}: direction must be 'both' or 'ab', got {direction!r}")
        if graph is not None and not graph.has_edge(a, b):
            raise ValueError(f"{where}: no link {a}-{b} in the bandwidth graph")
        rate = _rate(entry, where)
        out.append(BandwidthChange(float(at), (a, b), rate))
        if direction == "both":
            out.append(BandwidthChange(float(at), (b, a), rate))
    out.sort(key=lambda c: c.at)
    return out
