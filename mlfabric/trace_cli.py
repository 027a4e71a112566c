"""``mlfabric trace --scheduler ADDR --seconds N --out run.trace.json``: a running cluster's timeline.

Polls the scheduler's admin service (``mlfabric.v1.Admin/Trace``) for ``N`` seconds and
writes the transfers it planned and the transfers the daemons measured as a Chrome trace
JSON file, which ui.perfetto.dev (or ``chrome://tracing``) opens:

- one process per link (``h1->sw``) with two tracks, ``planned`` (each released transfer
  from its release to its planned end, at its planned rate) and ``measured`` (each reported
  transfer from its start to its end as the sending daemon timed it, at the rate it got);
  the slice's ``args`` hold the rate, the bytes and the share of the link's configured rate;
  transfers of one track that overlap go on extra lanes (``planned (2)``, ...);
- one process per job with two tracks per update: ``<update> planned`` (``queued`` from
  ready to release, then ``planned``) and ``<update> measured`` (the transfer, and the
  verdict as an instant: ``applied``, ``dropped`` with the reason, ``unknown``).
  Aggregates (``agg:...``) have their own tracks beside their members.

The scheduler keeps its most recent events in a bounded ring (32768 events): the trace
starts with what the ring still holds (``--from-now`` leaves that out), and events
overwritten before they were read are counted and reported (``lost``). Times are the
scheduler's clock, except measured transfers, which are the sending daemon's (hosts'
clocks should agree to well under a transfer's duration; a report ending in the scheduler's
future is placed to end when it arrived). Progress goes to stderr every second. Exit 0; 1
when the scheduler cannot be reached.

Example::

    mlfabric trace --scheduler sched.example:7077 --seconds 10 --out run.trace.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from mlfabric.wire.tls import TlsError, add_client_arguments, client_channel, client_error

__all__ = ["build_trace", "configure", "run"]

#: seconds between two polls when the scheduler has nothing more
POLL_INTERVAL = 0.2
#: events asked for per poll (the scheduler's most per reply)
_PAGE = 1024

# TraceEventKind values (admin.proto), kept here so --help does not import the stubs
_READY, _PLANNED, _MEASURED, _VERDICT, _CODEC = 1, 2, 3, 4, 5


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``mlfabric trace`` arguments to ``parser``."""
    parser.add_argument("--scheduler", required=True, metavar="HOST:PORT", help="the scheduler's address")
    add_client_arguments(parser)
    parser.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        metavar="N",
        help="seconds to record (default 10; 0: the ring only)",
    )
    parser.add_argument(
        "--out", required=True, metavar="FILE", help="the trace JSON to write (run.trace.json)"
    )
    parser.add_argument(
        "--from-now",
        action="store_true",
        help="leave out the events the scheduler kept from before the start",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for each answer (default 10)",
    )


def _schedule(events: Sequence[Any]) -> Any:
    """The transfers of ``events`` as a :class:`~mlfabric.scheduler.core.schedule.Schedule`."""
    from mlfabric.scheduler.core.schedule import Reservation, Schedule, Transfer

    transfers = []
    for e in events:
        path = tuple(e.path)
        if len(path) < 2 or e.end <= e.start:
            continue
        rate = e.bytes / (e.end - e.start)
        reservations = (
            tuple(Reservation(link, e.start, e.end, rate) for link in pairwise(path)) if rate > 0 else ()
        )
        transfers.append(
            Transfer(e.update_id, path[0], path[-1], path, e.start, e.end, e.bytes, reservations)
        )
    return Schedule(transfers=tuple(transfers))


def _x(name: str, pid: int, tid: int, start: float, end: float, origin: float, **args: Any) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": "update",
        "pid": pid,
        "tid": tid,
        "ts": (start - origin) * 1e6,
        "dur": max(0.0, end - start) * 1e6,
        "args": args,
    }


def _update_events(events: Sequence[Any], first_pid: int, origin: float) -> list[dict[str, Any]]:
    """A process per job, two tracks per update (planned, measured) in the order they appear."""
    job_of: dict[str, str] = {}
    for e in events:
        if e.job:
            job_of.setdefault(e.update_id, e.job)
    jobs = sorted(set(job_of.values()) | ({""} if any(e.update_id not in job_of for e in events) else set()))
    pid = {job: first_pid + i for i, job in enumerate(jobs)}
    tids: dict[str, int] = {}
    out: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": p,
            "tid": 0,
            "args": {"name": f"updates of job {job or '?'}"},
        }
        for job, p in pid.items()
    ]
    ready: dict[str, tuple[float, str]] = {}  # update id -> when it was announced, its codec
    for e in events:
        job = job_of.get(e.update_id, "")
        p = pid[job]
        if e.update_id not in tids:
            tids[e.update_id] = base = 2 * sum(1 for u in tids if job_of.get(u, "") == job) + 1
            for tid, what in ((base, "planned"), (base + 1, "measured")):
                name = f"{e.update_id} {what}"
                out.append({"ph": "M", "name": "thread_name", "pid": p, "tid": tid, "args": {"name": name}})
                out.append(
                    {
                        "ph": "M",
                        "name": "thread_sort_index",
                        "pid": p,
                        "tid": tid,
                        "args": {"sort_index": tid},
                    }
                )
        tid = tids[e.update_id]
        route = "->".join(e.path)
        if e.kind == _READY:
            ready[e.update_id] = (e.start, e.codec)
        elif e.kind == _PLANNED:
            since, codec = ready.pop(e.update_id, (None, ""))
            if since is not None and e.start > since:
                extra = {"codec": codec} if codec else {}
                out.append(_x("queued", p, tid, since, e.start, origin, worker_to_server=route, **extra))
            name = "planned aggregate" if e.aggregate else "planned"
            if e.end > e.start:
                rate = e.bytes / (e.end - e.start)
                out.append(
                    _x(name, p, tid, e.start, e.end, origin, route=route, bytes=e.bytes, rate_Bps=rate)
                )
            else:  # released without a planned duration (fair plans none)
                instant = {"ph": "i", "s": "t", "name": "released", "cat": "update", "pid": p, "tid": tid}
                out.append(
                    {**instant, "ts": (e.start - origin) * 1e6, "args": {"route": route, "bytes": e.bytes}}
                )
        elif e.kind == _MEASURED:
            rate = e.bytes / (e.end - e.start) if e.end > e.start else 0.0
            args: dict[str, Any] = {"route": route, "bytes": e.bytes, "rate_Bps": rate, "ok": e.ok}
            if e.outcome:
                args["outcome"] = e.outcome
            if e.reason:
                args["reason"] = e.reason
            if e.clock_from_receipt:
                args["clock_from_receipt"] = True
            out.append(_x("measured" if e.ok else "failed", p, tid + 1, e.start, e.end, origin, **args))
        elif e.kind == _VERDICT:
            instant = {"ph": "i", "s": "t", "name": e.outcome, "cat": "verdict", "pid": p, "tid": tid + 1}
            out.append(
                {**instant, "ts": (e.start - origin) * 1e6, "args": {"reason": e.reason} if e.reason else {}}
            )
    return out


def build_trace(
    events: Sequence[Any], capacities: Mapping[tuple[str, str], float] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Chrome trace events of a live run, and the file's metadata.

    Parameters
    ----------
    events : sequence
        ``TraceEvent`` messages (or :class:`~mlfabric.scheduler.service.tracelog.TraceRecord`),
        in the order the scheduler recorded them.
    capacities : mapping, optional
        Link -> configured bytes/s (slices show their share).

    Returns
    -------
    events : list of dict
        Per link (one process each): tracks ``planned`` and ``measured``; then per job its
        updates' tracks. Times are microseconds from the first event.
    metadata : dict
        ``origin_unix_seconds`` (time 0) and counts of transfers planned and measured,
        verdicts by outcome, links.

    Examples
    --------
    >>> from mlfabric.scheduler.service.tracelog import TraceLog
    >>> log = TraceLog(clock=lambda: 0.0, wall=lambda: 100.0)
    >>> log.planned("h1/1", "j", "ps", ("h1", "sw", "h0"), 8, 0.0, 2.0)
    >>> log.measured("h1/1", "j", "ps", ("h1", "sw", "h0"), 8, 99.0, 100.0, ok=True)
    >>> log.verdict("h1/1", "applied")
    >>> ev, meta = build_trace(log.since(0)[0])
    >>> sorted({(e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "process_name"})
    ['h1->sw', 'sw->h0', 'updates of job j']
    >>> [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in ev if e["ph"] == "X" and e["cat"] == "transfer"][:2]
    [(1, 1, 1000000.0, 2000000.0), (1, 2, 0.0, 1000000.0)]
    >>> meta["planned"], meta["measured"], meta["verdicts"]
    (1, 1, {'applied': 1})
    """
    from mlfabric.scheduler.core.round_trace import round_phases, round_slices, round_summary
    from mlfabric.scheduler.core.trace import compare_events

    codecs = [e for e in events if e.kind == _CODEC]  # the scheduler's codec choices (auto)
    events = [e for e in events if e.kind != _CODEC]
    origin = min((e.start for e in events if e.start > 0), default=0.0)
    planned = _schedule([e for e in events if e.kind == _PLANNED])
    measured = _schedule([e for e in events if e.kind == _MEASURED and e.ok])
    out = compare_events({"planned": planned, "measured": measured}, capacities=capacities, origin=origin)
    links = {r.link for s in (planned, measured) for t in s.transfers for r in t.reservations}
    out += _update_events(events, len(links) + 1, origin)
    rounds = round_phases(events)
    pids = [e["pid"] for e in out if "pid" in e]
    out += round_slices(rounds, max(pids, default=0) + 1, origin)
    out += _codec_events(codecs, max((e["pid"] for e in out if "pid" in e), default=0) + 1, origin)
    verdicts: dict[str, int] = {}
    for e in events:
        if e.kind == _VERDICT:
            verdicts[e.outcome] = verdicts.get(e.outcome, 0) + 1
    meta = {
        "origin_unix_seconds": origin,
        "planned": sum(1 for e in events if e.kind == _PLANNED),
        "measured": sum(1 for e in events if e.kind == _MEASURED),
        "verdicts": verdicts,
        "links": len(links),
        "rounds": round_summary(rounds),
        "codecs": {
            c: sum(1 for e in codecs if (e.codec or "none") == c) for c in {e.codec or "none" for e in codecs}
        },
    }
    return out, meta


def _codec_events(codecs: Sequence[Any], pid: int, origin: float) -> list[dict[str, Any]]:
    """The scheduler's codec choices (``CODEC`` events, ``auto``): one instant each, a process of theirs."""
    if not codecs:
        return []
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "codec choices (auto)"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "choices"}},
    ]
    for e in codecs:
        args = {
            "job": e.job,
            "server": e.server,
            "path": "->".join(e.path),
            "bytes": e.bytes,
            "bandwidth_Bps": e.bandwidth,
            "seconds": e.end - e.start,
            "seconds_none": e.seconds_none,
        }
        name = f"codec {e.codec or 'none'} for {e.path[0] if e.path else '?'}"
        out.append(
            {
                "ph": "i",
                "s": "p",
                "name": name,
                "cat": "codec",
                "pid": pid,
                "tid": 1,
                "ts": (e.start - origin) * 1e6,
                "args": args,
            }
        )
    return out


def _capacities(stub: Any, apb: Any, timeout: float) -> dict[tuple[str, str], float]:
    status = stub.Status(apb.StatusRequest(), timeout=timeout)
    return {(ls.src, ls.dst): ls.configured_bytes_per_second for ls in status.links}


def run(args: argparse.Namespace) -> int:
    """Poll the scheduler for ``--seconds`` and write the trace."""
    import grpc

    from mlfabric.proto.v1 import admin_pb2, admin_pb2_grpc
    from mlfabric.scheduler.core.trace import write_trace

    if args.seconds < 0:
        print(f"mlfabric trace: error: --seconds must be >= 0, got {args.seconds:g}", file=sys.stderr)
        return 2
    events: list[Any] = []
    lost = 0
    cursor = 0
    t0 = time.monotonic()
    shown = t0 - 1.0  # the first poll reports at once
    try:
        channel = client_channel(args)
    except TlsError as exc:
        print(f"mlfabric trace: error: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            capacities = _capacities(stub, admin_pb2, args.timeout)
            start_wall: float | None = None
            while True:
                reply = stub.Trace(
                    admin_pb2.TraceRequest(cursor=cursor, max_events=_PAGE), timeout=args.timeout
                )
                if start_wall is None:
                    start_wall = reply.now
                lost += reply.lost
                cursor = reply.next_cursor
                events.extend(e for e in reply.events if not args.from_now or e.start >= start_wall)
                now = time.monotonic()
                if not args.quiet and now - shown >= 1.0:
                    shown = now
                    print(
                        f"mlfabric trace: {now - t0:.0f}/{args.seconds:g} s, {len(events)} events"
                        + (f", {lost} lost" if lost else ""),
                        file=sys.stderr,
                        flush=True,
                    )
                if len(reply.events) >= _PAGE:
                    continue  # more are waiting
                if now - t0 >= args.seconds:
                    break
                time.sleep(min(POLL_INTERVAL, max(0.0, args.seconds - (now - t0))))
        except grpc.RpcError as exc:
            print(client_error("trace", args, exc), file=sys.stderr)
            return 1
    trace, meta = build_trace(events, capacities)
    meta.update(scheduler=args.scheduler, seconds=args.seconds, events=len(events), lost=lost)
    write_trace(args.out, trace, meta)
    if not args.quiet:
        print(
            f"mlfabric trace: wrote {args.out}: {meta['planned']} transfers planned, "
            f"{meta['measured']} measured, "
            f"{sum(meta['verdicts'].values())} verdicts on {meta['links']} links"
            + (f"; {lost} events lost (overwritten in the scheduler's ring before read)" if lost else "")
            + "; open it in ui.perfetto.dev",
            file=sys.stderr,
        )
        for name, r in meta["rounds"].items():

            def ms(key: str, r: dict[str, Any] = r) -> str:
                return "-" if r[key] is None else f"{r[key]:g} ms"

            print(
                f"mlfabric trace: rounds of {name}: {r['rounds']}, medians: verdicts {ms('verdicts_ms')}, "
                f"model + compute {ms('model_compute_ms')} (per member {ms('member_model_compute_ms')}), "
                f"transfers + apply {ms('transfers_apply_ms')}",
                file=sys.stderr,
            )
    return 0
