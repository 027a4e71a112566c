"""The scheduler's live timeline: a bounded ring of recent trace events (``mlfabric trace``).

:class:`TraceLog` keeps the last :data:`DEFAULT_CAPACITY` events of the running service,
each a small tuple appended to a ``deque(maxlen=...)``: recording is one clock read and one
append, and memory is bounded however long the scheduler runs (older events are
overwritten). The ring holds each event as a plain tuple of strings and numbers (its kind an
``int``), which the cyclic garbage collector stops tracking, and makes the
:class:`TraceRecord` only when it is read: a ``NamedTuple`` or an enum member in the ring kept
all 32,768 events tracked, and every full collection walked them (issue 24: the collector's
pauses grew with the events recorded while the ring filled).

Five kinds, recorded by the service state from its own mutations, through the
:class:`~.observe.Recorder` it was given (no hook in the core):

- ``READY``: an update was announced (the scheduler's time);
- ``PLANNED``: a transfer was released (an update's send, a member's send to its
  aggregator, an aggregate leaving its aggregator): route, bytes, release time and planned
  end, hence the planned rate;
- ``MEASURED``: a ``TransferReport``: bytes, start and end as the sending daemon measured
  them (its wall clock), ``ok`` and the outcome if the report carries one;
- ``VERDICT``: how an update's push resolved (APPLIED, DROPPED with the reason, UNKNOWN);
- ``CODEC``: the codec chosen for a worker host's pushes to a server (``auto``,
  docs/compression.md), with the choice's inputs: the path, the uncompressed bytes, the
  path's bandwidth share, and the expected seconds with the codec and without one.

Times are Unix seconds. The service's clock is monotonic: its times are shifted by the
offset between ``time.time()`` and the service clock taken when the log is made. A report
whose end lies more than :data:`CLOCK_TOLERANCE` seconds after its receipt (the sender's
clock is ahead) or that carries no times is placed to end at its receipt, with the
measured duration, and flagged ``clock_from_receipt``.

``Admin.Trace`` (:meth:`TraceLog.since`) returns the events from a cursor (a sequence
number); a client polls with the cursor of the previous reply and learns how many events
the ring overwrote before it asked (``lost``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from mlfabric.proto.v1 import admin_pb2 as apb

__all__ = ["CLOCK_TOLERANCE", "DEFAULT_CAPACITY", "MAX_REPLY", "Kind", "TraceLog", "TraceRecord"]

#: events kept (about 200 bytes each: a few MB at most)
DEFAULT_CAPACITY = 32768
#: events in one ``Admin.Trace`` reply at most (building it takes ~10 us an event on the loop)
MAX_REPLY = 1024
#: seconds a report's end may lie after its receipt before the sender's clock is distrusted
CLOCK_TOLERANCE = 1.0


class Kind(IntEnum):
    """Trace event kinds (the values of ``TraceEventKind`` in ``admin.proto``)."""

    READY = apb.TRACE_EVENT_KIND_READY
    PLANNED = apb.TRACE_EVENT_KIND_PLANNED
    MEASURED = apb.TRACE_EVENT_KIND_MEASURED
    VERDICT = apb.TRACE_EVENT_KIND_VERDICT
    CODEC = apb.TRACE_EVENT_KIND_CODEC


class TraceRecord(NamedTuple):
    """One recorded event (see ``TraceEvent`` in ``admin.proto`` for the fields)."""

    seq: int
    kind: Kind
    update_id: str
    job: str = ""
    server: str = ""
    worker: str = ""
    path: tuple[str, ...] = ()
    bytes: int = 0
    start: float = 0.0
    end: float = 0.0
    aggregate: bool = False
    outcome: str = ""
    reason: str = ""
    ok: bool = False
    clock_from_receipt: bool = False
    version: int = 0
    codec: str = ""
    bandwidth: float = 0.0
    seconds_none: float = 0.0

    def to_pb(self) -> apb.TraceEvent:
        """As the wire message (only the fields set: half the cost of setting every one)."""
        kw: dict[str, Any] = {
            "seq": self.seq,
            "kind": int(self.kind),
            "update_id": self.update_id,
            "start": self.start,
            "end": self.end,
        }
        for name in (
            "job",
            "server",
            "worker",
            "path",
            "bytes",
            "aggregate",
            "outcome",
            "reason",
            "ok",
            "version",
            "codec",
            "bandwidth",
            "seconds_none",
        ):
            value = getattr(self, name)
            if value:
                kw[name] = value
        if self.clock_from_receipt:
            kw["clock_from_receipt"] = True
        return apb.TraceEvent(**kw)


class TraceLog:
    """The ring of recent trace events.

    Parameters
    ----------
    capacity : int
        Events kept; older ones are overwritten.
    clock : callable
        The service's clock (monotonic seconds), the time base of the state's times.
    wall : callable
        Unix seconds (the daemons' clock in reports).

    Examples
    --------
    >>> t = [100.0]
    >>> log = TraceLog(capacity=3, clock=lambda: t[0], wall=lambda: t[0] + 1000.0)
    >>> log.ready("h1/1", "j", "ps", "w0", ("h1", "h0"), 8)
    >>> log.planned("h1/1", "j", "ps", ("h1", "sw", "h0"), 8, 100.0, 102.0)
    >>> log.measured("h1/1", "j", "ps", ("h1", "sw", "h0"), 8, 1099.5, 1100.0, ok=True, outcome="applied")
    >>> log.verdict("h1/1", "applied")
    >>> events, cursor, lost = log.since(0)
    >>> [(e.seq, e.kind.name, e.start, e.end) for e in events]
    [(2, 'PLANNED', 1100.0, 1102.0), (3, 'MEASURED', 1099.5, 1100.0), (4, 'VERDICT', 1100.0, 1100.0)]
    >>> cursor, lost
    (5, 0)
    >>> log.since(1)[2]  # the READY event was overwritten
    1
    >>> log.since(cursor)
    ([], 5, 0)
    """

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a trace log holds at least one event, not {capacity}")
        self.capacity = capacity
        self._events: deque[tuple[Any, ...]] = deque(maxlen=capacity)
        self._next = 1
        self._wall = wall
        self.set_clock(clock)

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Take the service's clock: its times are shifted to Unix seconds by today's offset."""
        self._offset = self._wall() - clock()

    def to_wall(self, t: float) -> float:
        """A time of the service's clock in Unix seconds."""
        return t + self._offset

    def now(self) -> float:
        """Unix seconds now."""
        return self._wall()

    def _add(self, record: TraceRecord) -> None:
        # a plain tuple, its kind a plain int: untracked by the cyclic collector (module docstring)
        self._events.append((record[0], int(record[1]), *record[2:]))
        self._next += 1

    def ready(
        self,
        update_id: str,
        job: str,
        server: str,
        worker: str,
        ends: tuple[str, str],
        nbytes: int,
        base_version: int = 0,
        codec: str = "",
    ) -> None:
        """``update_id`` (computed from model ``base_version``) was announced ready now, to go
        from ``ends[0]`` to ``ends[1]``, its payload encoded by ``codec`` ("": none)."""
        now = self._wall()
        self._add(
            TraceRecord(
                self._next,
                Kind.READY,
                update_id,
                job,
                server,
                worker,
                ends,
                nbytes,
                now,
                now,
                version=base_version,
                codec=codec,
            )
        )

    def planned(
        self,
        update_id: str,
        job: str,
        server: str,
        path: Sequence[str],
        nbytes: int,
        started_at: float,
        expected_end: float,
        *,
        aggregate: bool = False,
    ) -> None:
        """A transfer released at ``started_at`` and planned to end at ``expected_end`` (service clock)."""
        start, end = started_at + self._offset, expected_end + self._offset
        self._transfer(Kind.PLANNED, update_id, job, server, path, nbytes, start, end, aggregate)

    def measured(
        self,
        update_id: str,
        job: str,
        server: str,
        path: Sequence[str],
        nbytes: int,
        start: float,
        end: float,
        *,
        ok: bool,
        outcome: str = "",
        reason: str = "",
        aggregate: bool = False,
    ) -> None:
        """A transfer reported now; ``start``/``end`` are the sender's Unix seconds."""
        now = self._wall()
        from_receipt = start <= 0 or end < start or end > now + CLOCK_TOLERANCE
        if from_receipt:
            start, end = now - max(0.0, end - start), now
        self._transfer(
            Kind.MEASURED,
            update_id,
            job,
            server,
            path,
            nbytes,
            start,
            end,
            aggregate,
            outcome,
            reason,
            ok,
            from_receipt,
        )

    def _transfer(
        self,
        kind: Kind,
        update_id: str,
        job: str,
        server: str,
        path: Sequence[str],
        *fields: Any,
    ) -> None:
        """A PLANNED or MEASURED record: ``fields`` are those of :class:`TraceRecord` from ``bytes`` on."""
        self._add(TraceRecord(self._next, kind, update_id, job, server, "", tuple(path), *fields))

    def verdict(self, update_id: str, outcome: str, reason: str = "", version: int = 0) -> None:
        """The push of ``update_id`` resolved now with ``outcome`` (applied in ``version``)."""
        now = self._wall()
        self._add(
            TraceRecord(
                self._next,
                Kind.VERDICT,
                update_id,
                "",
                "",
                "",
                (),
                0,
                now,
                now,
                False,
                outcome,
                reason,
                version=version,
            )
        )

    def codec(
        self,
        job: str,
        server: str,
        path: Sequence[str],
        nbytes: int,
        codec: str,
        bandwidth: float,
        seconds: float,
        seconds_none: float,
    ) -> None:
        """The pushes along ``path`` to ``server`` of ``job`` travel with ``codec`` from now on.

        ``nbytes``: the update's uncompressed bytes; ``bandwidth``: the path's share the choice
        used (bytes/s); ``seconds`` (``end - start``) and ``seconds_none``: a push's expected
        time with the codec and without one.
        """
        now = self._wall()
        record = TraceRecord(
            self._next, Kind.CODEC, "", job, server, "", tuple(path), nbytes, now, now + seconds
        )
        self._add(record._replace(codec=codec, bandwidth=bandwidth, seconds_none=seconds_none))

    def since(self, cursor: int, limit: int = MAX_REPLY) -> tuple[list[TraceRecord], int, int]:
        """The events from sequence number ``cursor`` on (0: the oldest kept), at most ``limit``.

        Returns
        -------
        events : list of TraceRecord
        next_cursor : int
            One past the last event returned (the cursor of the next call).
        lost : int
            Events from ``cursor`` on that the ring no longer holds.

        A ``cursor`` beyond the newest event (a cursor of a scheduler since restarted) reads
        from the oldest event kept.
        """
        oldest = self._events[0][0] if self._events else self._next
        if not cursor or cursor > self._next:  # 0, or a cursor of an earlier incarnation
            cursor = oldest
        lost = max(0, min(oldest, self._next) - cursor)
        first = max(cursor, oldest)
        skip = first - oldest
        count = max(0, min(limit, self._next - first))
        # one pass (a deque indexes in O(n) away from its ends)
        rows = itertools.islice(self._events, skip, skip + count)
        events = [TraceRecord(r[0], Kind(r[1]), *r[2:]) for r in rows]
        return events, first + count, lost

    def reply(self, cursor: int, limit: int = 0) -> apb.TraceReply:
        """:meth:`since` as the ``Admin.Trace`` reply (``limit`` 0: :data:`MAX_REPLY`)."""
        events, next_cursor, lost = self.since(cursor, min(limit or MAX_REPLY, MAX_REPLY))
        return apb.TraceReply(
            events=[e.to_pb() for e in events],
            next_cursor=next_cursor,
            lost=lost,
            now=self._wall(),
            capacity=self.capacity,
        )
