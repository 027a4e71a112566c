"""Chrome trace of a plan: one track per link, one slice per reservation (paper §3.1.1, Fig. 4).

:func:`trace_events` turns a :class:`~mlfabric.scheduler.core.schedule.Schedule` into Chrome
trace-event dicts (pure); :func:`write_trace` writes them as the JSON that
``chrome://tracing`` and Perfetto (ui.perfetto.dev) open. Each directed link of the
bandwidth graph is a track (a "thread" named ``u->v``); each reservation of a transfer is a
complete event (``ph: "X"``) named after the payload, with its rate and share of the link's
capacity in ``args``, so time-sharing on a bottleneck shows as back-to-back slices and
fair sharing as stacked ones.

:func:`compare_events` draws several schedules of the same transfers side by side, one
trace process per link holding one track per schedule (``mlfabric trace``: what the
scheduler planned and what the daemons measured). Both build their slices with the same
code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlfabric.scheduler.core.schedule import Link, Reservation, Schedule, Transfer

__all__ = ["compare_events", "trace_events", "write_trace"]

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
    events += [_slice(r, t, pid, tid[link], capacities) for link, r, t in slices]
    return events


def _slice(
    r: Reservation,
    t: Transfer,
    pid: int,
    tid: int,
    capacities: Mapping[Link, float] | None,
    origin: float = 0.0,
) -> dict[str, Any]:
    """The complete event (``"X"``) of reservation ``r`` of transfer ``t`` on track ``(pid, tid)``."""
    args: dict[str, Any] = {"rate_Bps": r.rate, "bytes": r.rate * (r.end - r.start)}
    if t.replica:
        args["replica"] = True
    if capacities is not None and r.link in capacities:
        args["share"] = r.rate / capacities[r.link]
    return {
        "ph": "X",
        "name": t.payload_id,
        "cat": "replica" if t.replica else "transfer",
        "pid": pid,
        "tid": tid,
        "ts": (r.start - origin) * _US,
        "dur": (r.end - r.start) * _US,
        "args": args,
    }


def compare_events(
    schedules: Mapping[str, Schedule],
    *,
    capacities: Mapping[Link, float] | None = None,
    first_pid: int = 1,
    origin: float = 0.0,
) -> list[dict[str, Any]]:
    """Chrome trace events comparing schedules per link: a process per link, a track per schedule.

    Parameters
    ----------
    schedules : mapping
        Track name -> schedule (e.g. ``{"planned": ..., "measured": ...}``); the tracks of
        every link come in this order.
    capacities : mapping, optional
        Link -> capacity (bytes/s), to show each slice's share of its link.
    first_pid : int
        Process id of the first link (sorted by name); the next ones follow.
    origin : float
        Time (s) shown as 0.

    Returns
    -------
    list of dict
        Per link: its process and track names, then its slices sorted by track and start.
        Slices of one schedule that overlap go on extra tracks of it (``planned (2)``, ...).

    Examples
    --------
    >>> from mlfabric.scheduler.core.schedule import Transfer
    >>> plan = Schedule(transfers=(Transfer.at_rate("u1", ("w1", "ps"), start=10, bytes=2, rate=1),))
    >>> seen = Schedule(transfers=(Transfer.at_rate("u1", ("w1", "ps"), start=10.5, bytes=2, rate=2),))
    >>> ev = compare_events({"planned": plan, "measured": seen}, origin=10)
    >>> [(e["pid"], e["tid"], e["args"]["name"]) for e in ev if e["ph"] == "M"]
    [(1, 0, 'w1->ps'), (1, 1, 'planned'), (1, 2, 'measured')]
    >>> [(e["name"], e["tid"], e["ts"], e["dur"]) for e in ev if e["ph"] == "X"]
    [('u1', 1, 0.0, 2000000.0), ('u1', 2, 500000.0, 1000000.0)]
    """
    names = list(schedules)
    per_link: dict[Link, list[tuple[int, Reservation, Transfer]]] = {}
    for i, name in enumerate(names):
        for t in schedules[name].transfers:
            for r in t.reservations:
                if r.end > r.start:
                    per_link.setdefault(r.link, []).append((i + 1, r, t))
    events: list[dict[str, Any]] = []
    for pid, link in enumerate(sorted(per_link, key=_name), start=first_pid):
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": _name(link)}}
        )
        slices = sorted(per_link[link], key=lambda item: (item[0], item[1].start, item[2].payload_id))
        tid = 0
        for i, name in enumerate(names):
            lanes = _lanes([r for k, r, _ in slices if k == i + 1])
            for lane in range(max(lanes, default=0) + 1):
                label = name if lane == 0 else f"{name} ({lane + 1})"
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tid + lane + 1,
                        "args": {"name": label},
                    }
                )
            mine = [(r, t) for k, r, t in slices if k == i + 1]
            events += [
                _slice(r, t, pid, tid + lane + 1, capacities, origin)
                for (r, t), lane in zip(mine, lanes, strict=True)
            ]
            tid += max(lanes, default=0) + 1
    return events


def _lanes(reservations: list[Reservation]) -> list[int]:
    """The lane of each reservation (sorted by start) so that none overlaps another in its lane.

    A trace viewer draws one track's slices as a stack of nested calls: transfers that
    overlap without nesting (fair sharing, a release within the margin) go on extra lanes.

    Examples
    --------
    >>> r = [Reservation(("a", "b"), s, e, 1.0) for s, e in ((0, 2), (1, 3), (2, 4), (2.5, 3))]
    >>> _lanes(r)
    [0, 1, 0, 2]
    """
    ends: list[float] = []
    out = []
    for r in reservations:
        lane = next((i for i, end in enumerate(ends) if end <= r.start), len(ends))
        if lane == len(ends):
            ends.append(r.end)
        else:
            ends[lane] = r.end
        out.append(lane)
    return out


def write_trace(
    path: str | Path, events: list[dict[str, Any]], metadata: Mapping[str, Any] | None = None
) -> None:
    """Write trace events (from one or more :func:`trace_events` calls) as a Chrome trace file.

    ``metadata`` goes in the file's ``otherData`` (shown by Perfetto's trace info).

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.json")
    >>> write_trace(p, [])
    >>> json.load(open(p))["traceEvents"]
    []
    """
    body: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        body["otherData"] = dict(metadata)
    Path(path).write_text(json.dumps(body, indent=None))
