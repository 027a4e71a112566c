"""The time between a server's rounds, split by component, from the scheduler's trace events.

A round of a synchronous server (``sync_workers``) is one version: its members' updates are
applied together, each member then gets the new model, computes, and pushes the next
round's update. From the events the scheduler records (``mlfabric trace``), per version
``v`` of a server:

- *applied*: the first verdict ``applied`` in ``v`` (the server's apply, as its report
  reached the scheduler);
- *verdicts*: from there to the last verdict of ``v`` (every member resolved);
- *model + compute*: from the last verdict to the last update computed from ``v``
  announced ready (the slowest member's model transfer and compute; per member, from its
  own verdict to its next update, in ``per_member``);
- *transfers + apply*: from there to the apply of the next version (the next round's
  transfers, sums and the apply).

The three add up to the time between two applies. Pure functions over the trace's events.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RoundPhases", "round_phases", "round_slices", "round_summary"]

# TraceEventKind values (admin.proto)
_READY, _VERDICT = 1, 4


@dataclass(frozen=True)
class RoundPhases:
    """One version of a server and what followed it (times in the events' seconds).

    Attributes
    ----------
    job, server : str
        The server.
    version : int
        The version the round's members were applied in.
    members : int
        Updates applied in ``version``.
    applied_at : float
        The first verdict ``applied`` in ``version``.
    verdicts_done : float
        The last verdict in ``version``.
    last_ready : float or None
        The last update computed from ``version`` announced ready (None: none seen).
    next_applied_at : float or None
        The apply of the next version (None: not seen).
    per_member : tuple of float
        Per member with a next update: seconds from its verdict to that update.
    """

    job: str
    server: str
    version: int
    members: int
    applied_at: float
    verdicts_done: float
    last_ready: float | None
    next_applied_at: float | None
    per_member: tuple[float, ...]

    @property
    def verdicts(self) -> float:
        """Seconds from the apply to the last verdict."""
        return self.verdicts_done - self.applied_at

    @property
    def model_compute(self) -> float | None:
        """Seconds from the last verdict to the last next update (0 if that came first)."""
        return None if self.last_ready is None else max(0.0, self.last_ready - self.verdicts_done)

    @property
    def transfers_apply(self) -> float | None:
        """Seconds from the last next update to the next apply."""
        if self.last_ready is None or self.next_applied_at is None:
            return None
        return max(0.0, self.next_applied_at - max(self.last_ready, self.verdicts_done))


def round_phases(events: Sequence[Any], *, min_members: int = 2) -> list[RoundPhases]:
    """The rounds of every server in ``events`` (versions with ``min_members`` applied or more).

    Parameters
    ----------
    events : sequence
        Trace events (``TraceEvent`` messages or
        :class:`~mlfabric.scheduler.service.tracelog.TraceRecord`), as recorded.
    min_members : int, optional
        Versions with fewer updates applied are left out (an asynchronous server applies
        updates one by one: those are not rounds).

    Returns
    -------
    list of RoundPhases
        By server, then version.

    Examples
    --------
    Two workers; version 1 applied at 10.0 (verdicts until 10.1), their next updates ready
    at 10.4 and 10.5, version 2 applied at 11.0:

    >>> from mlfabric.scheduler.service.tracelog import TraceLog
    >>> t = [9.0]
    >>> log = TraceLog(clock=lambda: t[0], wall=lambda: t[0])
    >>> def at(s, f, *a, **k):
    ...     t[0] = s
    ...     f(*a, **k)
    >>> for w in ("a", "b"):
    ...     at(9.0, log.ready, f"{w}/1", "j", "ps", w, (w, "ps"), 8, 0)
    >>> at(10.0, log.verdict, "a/1", "applied", version=1)
    >>> at(10.1, log.verdict, "b/1", "applied", version=1)
    >>> at(10.4, log.ready, "a/2", "j", "ps", "a", ("a", "ps"), 8, 1)
    >>> at(10.5, log.ready, "b/2", "j", "ps", "b", ("b", "ps"), 8, 1)
    >>> at(11.0, log.verdict, "a/2", "applied", version=2)
    >>> at(11.0, log.verdict, "b/2", "applied", version=2)
    >>> r = round_phases(log.since(0)[0])[0]
    >>> r.version, r.members, round(r.verdicts, 3), round(r.model_compute, 3), round(r.transfers_apply, 3)
    (1, 2, 0.1, 0.4, 0.5)
    >>> [round(x, 3) for x in r.per_member]
    [0.4, 0.4]
    """
    key_of: dict[str, tuple[str, str, str]] = {}  # update id -> job, server, worker
    ready: dict[tuple[str, str, int], dict[str, float]] = {}  # (job, server, base) -> worker -> t
    verdicts: dict[tuple[str, str, int], dict[str, float]] = {}  # (job, server, version) -> worker -> t
    for e in events:
        if e.kind == _READY and e.job:
            key_of[e.update_id] = (e.job, e.server, e.worker)
            ready.setdefault((e.job, e.server, e.version), {})[e.worker] = e.start
        elif e.kind == _VERDICT and e.outcome == "applied" and e.version > 0 and e.update_id in key_of:
            job, server, worker = key_of[e.update_id]
            verdicts.setdefault((job, server, e.version), {}).setdefault(worker, e.start)
    out = []
    for (job, server, v), got in sorted(verdicts.items()):
        if len(got) < min_members:
            continue
        nxt = verdicts.get((job, server, v + 1))
        following = ready.get((job, server, v), {})
        out.append(
            RoundPhases(
                job,
                server,
                v,
                len(got),
                min(got.values()),
                max(got.values()),
                max(following.values(), default=None),
                min(nxt.values()) if nxt else None,
                tuple(following[w] - t for w, t in sorted(got.items()) if w in following),
            )
        )
    return out


def round_summary(rounds: Sequence[RoundPhases]) -> dict[str, dict[str, float | None]]:
    """Per server (``job/server``): rounds and the median milliseconds of each component
    (None where no round had it).

    Examples
    --------
    >>> r = RoundPhases("j", "ps", 1, 2, 10.0, 10.1, 10.5, 11.0, (0.4, 0.4))
    >>> s = round_summary([r])["j/ps"]
    >>> s["rounds"], s["verdicts_ms"], s["model_compute_ms"], s["transfers_apply_ms"]
    (1, 100.0, 400.0, 500.0)
    """
    by: dict[str, list[RoundPhases]] = {}
    for r in rounds:
        by.setdefault(f"{r.job}/{r.server}", []).append(r)
    out: dict[str, dict[str, float | None]] = {}
    for name, rs in by.items():

        def med(xs: Sequence[float | None]) -> float | None:
            values = [x for x in xs if x is not None]
            return round(statistics.median(values) * 1e3, 1) if values else None

        out[name] = {
            "rounds": len(rs),
            "verdicts_ms": med([r.verdicts for r in rs]),
            "model_compute_ms": med([r.model_compute for r in rs]),
            "transfers_apply_ms": med([r.transfers_apply for r in rs]),
            "member_model_compute_ms": med([x for r in rs for x in r.per_member]),
        }
    return out


def round_slices(rounds: Sequence[RoundPhases], first_pid: int, origin: float) -> list[dict[str, Any]]:
    """Chrome trace slices: a process per server, one track of its rounds' components."""
    pids: Mapping[str, int] = {
        name: first_pid + i for i, name in enumerate(sorted({f"{r.job}/{r.server}" for r in rounds}))
    }
    out: list[dict[str, Any]] = []
    for name, pid in pids.items():
        out.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rounds of {name}"}}
        )
        out.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "between applies"}}
        )
    for r in rounds:
        pid = pids[f"{r.job}/{r.server}"]
        parts = [("verdicts", r.applied_at, r.verdicts_done)]
        if r.last_ready is not None:
            start = max(r.last_ready, r.verdicts_done)
            parts.append(("model + compute", r.verdicts_done, start))
            if r.next_applied_at is not None:
                parts.append(("transfers + apply", start, r.next_applied_at))
        for label, a, b in parts:
            out.append(
                {
                    "ph": "X",
                    "name": f"{label} (v{r.version})",
                    "cat": "round",
                    "pid": pid,
                    "tid": 1,
                    "ts": (a - origin) * 1e6,
                    "dur": max(0.0, b - a) * 1e6,
                    "args": {"version": r.version, "members": r.members, "per_member_s": list(r.per_member)},
                }
            )
    return out
