"""Chrome trace of a plan: one track per link, one slice per reservation (paper §3.1.1, Fig. 4).

:func:`trace_events` turns a :class:`~mlfabric.scheduler.core.schedule.Schedule` into Chrome
trace-event dicts (pure); :func:`write_trace` writes them as the JSON that
``chrome://tracing`` and Perfetto (ui.perfetto.dev) open. Each directed link of the
bandwidth graph is a track (a "thread" named ``u->v``); each reservation of a transfer is a
complete event (``ph: "X"``) named after the payload, with its rate and share of the link's
capacity in ``args``, so time-sharing on a bottleneck shows as back-to-back slices and
fair sharing as stacked ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlfabric.scheduler.core.schedule import Link, Schedule

__all__ = ["trace_events", "write_trace"]

_US = 1e6  # trace timestamps are microseconds


def _name(link: Link) -> str:
    return f"{link[0]}->{link[1]}"


def trace_events(
    schedule: Schedule,
    *,
    capacities: Mapping[Link, float] | None = None,
    process: str = "links",
    pid: int = 1,
) -> list[dict[str, Any]]:
    """Chrome trace events for ``schedule``: a track per link, a slice per reservation.

    Parameters
    ----------
    schedule : Schedule
        The plan (STF, fair, ILP, a simulation's record).
    capacities : mapping, optional
        Link -> capacity (bytes/s), to show each slice's share of its link.
    process : str
        Name of the trace "process" holding the link tracks (e.g. the solver's name).
    pid : int
        Its process id in the trace (distinct per plan when several go in one file).

    Returns
    -------
    list of dict
        Metadata events naming the process and tracks, then one ``"X"`` event per
        reservation, sorted by link and start.

    Examples
    --------
    >>> from mlfabric.scheduler.core.schedule import Transfer
    >>> s = Schedule(transfers=(Transfer.at_rate("u1", ("w1", "sw", "ps"), start=0, bytes=2, rate=1),))
    >>> ev = trace_events(s)
    >>> [e["args"]["name"] for e in ev if e["ph"] == "M"]
    ['links', 'sw->ps', 'w1->sw']
    >>> [(e["name"], e["tid"], e["ts"], e["dur"]) for e in ev if e["ph"] == "X"]
    [('u1', 1, 0.0, 2000000.0), ('u1', 2, 0.0, 2000000.0)]
    """
    slices = [(r.link, r, t) for t in schedule.transfers for r in t.reservations if r.end > r.start]
    links = sorted({link for link, _, _ in slices}, key=_name)
    tid = {link: i + 1 for i, link in enumerate(links)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}
    ]
    events += [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[link], "args": {"name": _name(link)}}
        for link in links
    ]
    slices.sort(key=lambda item: (tid[item[0]], item[1].start, item[2].payload_id))
    for link, r, t in slices:
        args: dict[str, Any] = {"rate_Bps": r.rate, "bytes": r.rate * (r.end - r.start)}
        if t.replica:
            args["replica"] = True
        if capacities is not None and link in capacities:
            args["share"] = r.rate / capacities[link]
        events.append(
            {
                "ph": "X",
                "name": t.payload_id,
                "cat": "replica" if t.replica else "transfer",
                "pid": pid,
                "tid": tid[link],
                "ts": r.start * _US,
                "dur": (r.end - r.start) * _US,
                "args": args,
            }
        )
    return events


def write_trace(path: str | Path, events: list[dict[str, Any]]) -> None:
    """Write trace events (from one or more :func:`trace_events` calls) as a Chrome trace file.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.json")
    >>> write_trace(p, [])
    >>> json.load(open(p))["traceEvents"]
    []
    """
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=None))
