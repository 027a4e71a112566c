"""What the running scheduler notes about itself, once, and the snapshot its readers take (DESIGN §7.4).

The service is observed in one place. Its :class:`~.state.SchedulerState` is given a
:class:`Recorder` and notes each of its own changes there (an update ready, a transfer
released or reported, an aggregate leaving its aggregator, a verdict); the
:class:`~.core.SchedulerCore` and its replicas' book count what only they see (notifications,
releases, decisions and their time, measured transfers, replica waits and promotions) in the
same recorder. Nothing observes by overriding what it observes.

- :class:`Activity`: recent pushes per worker and transfers per link, in the service's clock
  (``mlfabric status``, :mod:`.admin`);
- the trace ring, :class:`~.tracelog.TraceLog`, if the recorder has one (``mlfabric trace``);
- counters: plain integers and :class:`Buckets` (histograms), read by :meth:`Recorder.stats`
  with the gauges of the state into a :class:`ServiceStats`, the plain snapshot
  ``SchedulerCore.stats()`` returns and the one Prometheus collector
  (:class:`~.metrics.ServiceCollector`) reports at each scrape.

Nothing here does I/O or reads a clock: times are passed in.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import networkx as nx

from mlfabric.scheduler.core.codec_choice import CodecChoice
from mlfabric.scheduler.core.schedule import is_aggregate_id
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate
from mlfabric.scheduler.service.records import OutcomeKind, TransferResult, UpdateOutcome
from mlfabric.scheduler.service.tracelog import TraceLog

if TYPE_CHECKING:  # the state imports this module
    from mlfabric.scheduler.service.state import SchedulerState

__all__ = [
    "DECISION_BUCKETS",
    "DELAY_BUCKETS",
    "DURATION_BUCKETS",
    "HISTORY",
    "MIN_SPAN",
    "Activity",
    "Buckets",
    "Recorder",
    "ServiceStats",
    "drop_reason_class",
    "per_link",
    "per_server",
]

Link = tuple[str, str]

#: buckets of the update-delay histogram, in server versions
DELAY_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64)
#: buckets of the decision-time histogram, seconds (1-2-5 steps from 1 ms: a quantile read off
#: them is bounded within a factor 2.5, and 20 ms, issue 24's p99 target, is a bound)
DECISION_BUCKETS: tuple[float, ...] = (
    1e-5,
    1e-4,
    5e-4,
    1e-3,
    2e-3,
    5e-3,
    1e-2,
    2e-2,
    5e-2,
    0.1,
    0.2,
    0.5,
    1.0,
)
#: buckets of the transfer completion-time histogram, seconds
DURATION_BUCKETS: tuple[float, ...] = (1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)
#: events kept per worker or link
_MAX_EVENTS = 4096
#: the shortest span rates are averaged over (:meth:`Activity.span`), seconds
MIN_SPAN = 1.0
#: seconds of pushes and transfers :class:`Activity` keeps (a longer window is cut to it)
HISTORY = 300.0


def drop_reason_class(reason: str) -> str:
    """A drop reason without quoted names, numbers and details: a small label set.

    Examples
    --------
    >>> drop_reason_class("delay 9 > tau_max 8 (server version 12, base_version 3)")
    'delay > tau_max'
    >>> drop_reason_class("the daemon of host 'w1' disconnected")
    'the daemon of host disconnected'
    >>> drop_reason_class("")
    'unspecified'
    """
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "", reason)
    text = re.split(r"[:(]", text, maxsplit=1)[0]
    text = re.sub(r"\b\d[\d.e+-]*\b", "", text)
    text = " ".join(text.split())[:60]
    return text or "unspecified"


def per_server(items: Iterable[PendingUpdate | InFlight]) -> dict[tuple[str, str], int]:
    """How many of ``items`` (updates pending or in flight) go to each (job, server).

    Examples
    --------
    >>> per_server([InFlight("a", "j", "ps", ("h1", "h0"), 8, 0.0, 1.0)] * 2)
    {('j', 'ps'): 2}
    """
    out: dict[tuple[str, str], int] = {}
    for u in items:
        out[(u.job, u.server)] = out.get((u.job, u.server), 0) + 1
    return out


def per_link(flights: Iterable[InFlight]) -> dict[Link, int]:
    """How many transfers in flight cross each link.

    Examples
    --------
    >>> per_link([InFlight("a", "j", "ps", ("h1", "sw", "h0"), 8, 0.0, 1.0)])
    {('h1', 'sw'): 1, ('sw', 'h0'): 1}
    """
    crossing: dict[Link, int] = {}
    for f in flights:
        for link in pairwise(f.path):
            crossing[link] = crossing.get(link, 0) + 1
    return crossing


class Buckets:
    """A histogram's counts: observations per bucket (upper bounds inclusive, then +Inf) and their sum.

    Parameters
    ----------
    bounds : sequence of float
        The buckets' upper bounds, increasing.

    Examples
    --------
    >>> b = Buckets((1, 2))
    >>> for v in (0.5, 1, 3):
    ...     b.observe(v)
    >>> b.counts, b.count, b.sum, b.cumulative()
    ([2, 0, 1], 3, 4.5, [(1, 2), (2, 2), (inf, 3)])
    """

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound it does not exceed."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Observations in all."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations up to it) per bucket, the last bound ``inf``."""
        out, total = [], 0
        for bound, n in zip([*self.bounds, float("inf")], self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def copy(self) -> Buckets:
        """An independent copy (for a snapshot)."""
        b = Buckets(self.bounds)
        b.counts, b.sum = list(self.counts), self.sum
        return b


class Activity:
    """Recent pushes per (job, worker) and transfers per link; times are the service's clock.

    Only the last ``history`` seconds are kept (at most :data:`_MAX_EVENTS` events per worker
    or link): each note drops its worker's or link's events older than that, and once per
    ``history`` seconds the events of every worker and link are trimmed alike and the idle
    ones forgotten, so what is kept is bounded by the pushes and transfers of the last two
    ``history`` spans, not by those seen since the start (issue 24: with 4,000 daemons the
    per-link events of a 10-minute run were still filling towards 4,096 per link). A window
    longer than ``history`` is cut to it (:meth:`span`).

    Parameters
    ----------
    history : float
        Seconds of pushes and transfers kept (default :data:`HISTORY`).

    Examples
    --------
    >>> a = Activity()
    >>> for t in (0.0, 1.0, 2.0):
    ...     a.push("j", "w0", t)
    >>> a.worker_rate("j", "w0", now=2.0, window=10.0)
    (0.3, 1.0, 3)
    >>> a.transfer(("w0", "sw", "ps"), 1000, now=2.0)
    >>> a.link_bytes(("w0", "sw"), now=2.0, window=10.0)
    1000
    >>> a.span(now=2.0, window=10.0), a.span(now=60.0, window=10.0), a.span(now=900.0, window=600.0)
    (2.0, 10.0, 300.0)
    """

    def __init__(self, history: float = HISTORY) -> None:
        if not history > 0:
            raise ValueError(f"an activity keeps a positive number of seconds, not {history}")
        self.history = history
        #: when the first push or transfer was noted (None: nothing yet)
        self.started: float | None = None
        self._pushes: dict[tuple[str, str], deque[float]] = {}
        self._links: dict[tuple[str, str], deque[tuple[float, int]]] = {}
        #: link -> bytes of every transfer released over it so far
        self.scheduled: dict[tuple[str, str], int] = {}
        self._trimmed = -math.inf  # when every worker's and link's events were last trimmed

    def span(self, now: float, window: float) -> float:
        """The seconds of activity a ``window`` behind ``now`` covers: less than the window early
        in a run (since the first push or transfer, at least :data:`MIN_SPAN`), so rates are
        averaged over the time there was, not over seconds before anything ran; at most the
        ``history`` kept."""
        window = min(window, self.history)
        if self.started is None:
            return window
        return min(window, max(now - self.started, MIN_SPAN))

    def push(self, job: str, worker: str, now: float) -> None:
        """``worker`` of ``job`` announced an update at ``now``."""
        if self.started is None:
            self.started = now
        times = self._pushes.setdefault((job, worker), deque(maxlen=_MAX_EVENTS))
        times.append(now)
        _expire(times, now - self.history, _at)
        self._trim(now)

    def released(self, path: Sequence[str], nbytes: int) -> None:
        """A transfer of ``nbytes`` along ``path`` was released (scheduled)."""
        for link in pairwise(path):
            self.scheduled[link] = self.scheduled.get(link, 0) + nbytes

    def transfer(self, path: Sequence[str], nbytes: int, now: float) -> None:
        """A transfer of ``nbytes`` along ``path`` was reported at ``now``."""
        if self.started is None:
            self.started = now
        cut = now - self.history
        for link in pairwise(path):
            events = self._links.setdefault(link, deque(maxlen=_MAX_EVENTS))
            events.append((now, nbytes))
            _expire(events, cut, _first)
        self._trim(now)

    def _trim(self, now: float) -> None:
        """Once per ``history`` s: drop every worker's and link's events older than it, and the idle."""
        if now - self._trimmed < self.history:
            return
        self._trimmed = now
        cut = now - self.history
        for times in self._pushes.values():
            _expire(times, cut, _at)
        for events in self._links.values():
            _expire(events, cut, _first)
        self._pushes = {key: times for key, times in self._pushes.items() if times}
        self._links = {link: events for link, events in self._links.items() if events}

    def worker_rate(self, job: str, worker: str, now: float, window: float) -> tuple[float, float, int]:
        """(pushes per second, mean seconds between pushes or 0, pushes) over the window (give
        :meth:`span`'s, early in a run)."""
        times = [t for t in self._pushes.get((job, worker), ()) if t >= now - window]
        interval = (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else 0.0
        return len(times) / window, interval, len(times)

    def link_bytes(self, link: tuple[str, str], now: float, window: float) -> int:
        """Bytes reported over ``link`` in the window."""
        return sum(n for t, n in self._links.get(link, ()) if t >= now - window)


def _at(t: float) -> float:
    return t


def _first(event: tuple[float, int]) -> float:
    return event[0]


def _expire(events: deque[Any], cut: float, when: Callable[[Any], float]) -> None:
    """Drop the events at the left of ``events`` noted before ``cut`` (``when`` reads an event's time)."""
    while events and when(events[0]) < cut:
        events.popleft()


@dataclass(frozen=True)
class ServiceStats:
    """The scheduler's counters and gauges at one moment: what one scrape reports.

    Counters only grow; gauges are read off the state when the snapshot is taken. Links are
    ``(src, dst)``, servers and replicas ``(job, server)``. The Prometheus names are those of
    :class:`~.metrics.ServiceCollector` (``mlfabric_`` and the field's name, mostly).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.state import SchedulerState
    >>> s = SchedulerState(star(2, 8e9))
    >>> st = s.recorder.stats(s, s.graph)
    >>> st.daemons_connected, st.updates_ready, len(st.link_capacity), st.decision_seconds.count
    (0, 0, 4, 0)
    """

    updates_ready: int
    updates_applied: int
    updates_dropped: int
    updates_unknown: int
    transfers_released: int
    decision_seconds: Buckets
    #: bytes of measured transfers per link, and their completion times
    link_transferred_bytes: dict[Link, int]
    transfer_duration_seconds: Buckets
    #: bytes of the transfers released over each link
    link_scheduled_bytes: dict[Link, int]
    #: outcomes the state recorded, by kind (``applied``, ``dropped``, ``unknown``)
    updates_resolved: dict[str, int]
    updates_dropped_by_reason: dict[str, int]
    update_delay_versions: Buckets
    replica_server_waits: dict[tuple[str, str], int]
    replica_promotions: int
    replica_divergence: dict[tuple[str, str], float]
    replica_resyncing: dict[tuple[str, str], int]
    link_capacity: list[tuple[str, str, float]]
    link_estimated: list[tuple[str, str, float]]
    link_in_flight: dict[Link, int]
    pending_updates: dict[tuple[str, str], int]
    daemons_connected: int
    jobs: int
    #: all-reduce plans made, by (executor, kind): ("daemons" | "process_group", "tree" | "ring" | "native")
    allreduce_plans: dict[tuple[str, str], int] = field(default_factory=dict)
    #: codecs chosen for a worker host's pushes to a server (``auto``), by codec (``none``, ...)
    codec_choices: dict[str, int] = field(default_factory=dict)


class Recorder:
    """Where the scheduler's state, core and replicas' book note what happens (see the module docstring).

    Parameters
    ----------
    trace : TraceLog, optional
        The live timeline: updates ready, transfers released (planned) and reported
        (measured), verdicts.
    activity : Activity, optional
        Behind ``mlfabric status`` (a fresh one by default).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.state import SchedulerState
    >>> from mlfabric.scheduler.service.records import JobParams, OutcomeKind
    >>> s = SchedulerState(star(2, 8e9), Recorder())
    >>> _ = s.connect("h0", "127.0.0.1:1"); _ = s.connect("h1", "127.0.0.1:2")
    >>> _ = s.register_server("h0", "j", "ps", (), JobParams(), version=0)
    >>> _ = s.register_worker("h1", "j", "w0")
    >>> _ = s.add_update("h1", "h1/1", "j", "ps", "w0", 8, 1.0, 0, now=0.0)
    >>> s.record("h1/1", OutcomeKind.APPLIED, "", 2, 1)
    >>> st = s.recorder.stats(s, s.graph)
    >>> st.pending_updates, st.updates_resolved, st.update_delay_versions.counts[:4]
    ({('j', 'ps'): 1}, {'applied': 1, 'dropped': 0}, [0, 0, 1, 0])
    """

    def __init__(self, trace: TraceLog | None = None, activity: Activity | None = None) -> None:
        self.activity = Activity() if activity is None else activity
        self.trace = trace
        #: the core's counts: notifications, verdicts it passed on, sends released, decisions
        self.updates_ready = 0
        self.updates_applied = 0
        self.updates_dropped = 0
        self.updates_unknown = 0
        self.transfers_released = 0
        self.decision_seconds = Buckets(DECISION_BUCKETS)
        #: measured transfers (what feeds the bandwidth estimator)
        self.link_transferred_bytes: dict[Link, int] = {}
        self.transfer_duration_seconds = Buckets(DURATION_BUCKETS)
        #: outcomes the state recorded (an update recorded again counts again)
        self.updates_resolved: dict[str, int] = {"applied": 0, "dropped": 0}
        self.updates_dropped_by_reason: dict[str, int] = {}
        self.update_delay_versions = Buckets(DELAY_BUCKETS)
        #: replicas (the last value set for each gauge, as a Prometheus gauge keeps it)
        self.replica_server_waits: dict[tuple[str, str], int] = {}
        self.replica_promotions = 0
        self.replica_divergence: dict[tuple[str, str], float] = {}
        self.replica_resyncing: dict[tuple[str, str], int] = {}
        #: codec choices sent (``auto``), by codec
        self.codec_choices: dict[str, int] = {}

    # ----------------------------------------------------- the state's changes

    def update_ready(self, u: PendingUpdate) -> None:
        """``u`` was announced (at ``u.ready_at``)."""
        self.activity.push(u.job, u.worker, u.ready_at)
        if self.trace is not None:
            ends = (u.src_host, u.dst_host)
            self.trace.ready(u.update_id, u.job, u.server, u.worker, ends, u.bytes, u.base_version, u.codec)

    def released(self, f: InFlight) -> None:
        """Transfer ``f`` was released: its bytes are scheduled on each link of its path."""
        self.activity.released(f.path, f.bytes)
        if self.trace is not None:
            self.trace.planned(f.update_id, f.job, f.server, f.path, f.bytes, f.started_at, f.expected_end)

    def forwarded(self, f: InFlight) -> None:
        """Aggregate ``f`` left its aggregator (traced as planned)."""
        if self.trace is not None:
            self.trace.planned(
                f.update_id, f.job, f.server, f.path, f.bytes, f.started_at, f.expected_end, aggregate=True
            )

    def reported(self, f: InFlight, result: TransferResult) -> None:
        """The transfer ``f`` was reported (traced as measured)."""
        if self.trace is not None:
            self.trace.measured(
                f.update_id,
                f.job,
                f.server,
                f.path,
                result.bytes,
                result.start,
                result.end,
                ok=result.ok,
                outcome="" if result.outcome is None else result.outcome.value,
                reason=result.reason or result.error,
                aggregate=is_aggregate_id(f.update_id),
            )

    def resolved(self, outcome: UpdateOutcome) -> None:
        """The state recorded ``outcome``: trace the verdict, count it by kind, reason and delay."""
        if self.trace is not None:
            self.trace.verdict(outcome.update_id, outcome.kind.value, outcome.reason, outcome.version or 0)
        kind = outcome.kind.name.lower()
        self.updates_resolved[kind] = self.updates_resolved.get(kind, 0) + 1
        if kind == "dropped":
            cls = drop_reason_class(outcome.reason)
            self.updates_dropped_by_reason[cls] = self.updates_dropped_by_reason.get(cls, 0) + 1
        elif outcome.delay is not None:
            self.update_delay_versions.observe(outcome.delay)

    # ------------------------------------------------------- the core's counts

    def count(self, kind: OutcomeKind) -> None:
        """The core passed on a verdict: APPLIED, UNKNOWN, or else DROPPED."""
        if kind is OutcomeKind.APPLIED:
            self.updates_applied += 1
        elif kind is OutcomeKind.UNKNOWN:
            self.updates_unknown += 1
        else:
            self.updates_dropped += 1

    def codec_chosen(self, job: str, server: str, path: Sequence[str], choice: CodecChoice) -> None:
        """The pushes along ``path`` to ``server`` of ``job`` travel with ``choice.codec`` now."""
        name = choice.codec.partition(":")[0] or "none"
        self.codec_choices[name] = self.codec_choices.get(name, 0) + 1
        if self.trace is not None:
            c = choice
            self.trace.codec(job, server, path, c.nbytes, c.codec, c.bandwidth, c.seconds, c.seconds_none)

    def measured(self, path: Sequence[str], nbytes: int, duration: float, now: float) -> None:
        """A transfer of ``nbytes`` along ``path`` took ``duration`` s (reported at ``now``)."""
        for link in pairwise(path):
            self.link_transferred_bytes[link] = self.link_transferred_bytes.get(link, 0) + nbytes
        self.transfer_duration_seconds.observe(duration)
        self.activity.transfer(path, nbytes, now)

    # ---------------------------------------------------------------- reading

    def stats(self, state: SchedulerState, estimated: nx.DiGraph) -> ServiceStats:
        """The counters noted here and the gauges of ``state`` now (``estimated``: the estimator's graph).

        Run it where the state is mutated (the service's loop): it copies what it reports.
        """
        return ServiceStats(
            updates_ready=self.updates_ready,
            updates_applied=self.updates_applied,
            updates_dropped=self.updates_dropped,
            updates_unknown=self.updates_unknown,
            transfers_released=self.transfers_released,
            decision_seconds=self.decision_seconds.copy(),
            link_transferred_bytes=dict(self.link_transferred_bytes),
            transfer_duration_seconds=self.transfer_duration_seconds.copy(),
            link_scheduled_bytes=dict(self.activity.scheduled),
            updates_resolved=dict(self.updates_resolved),
            updates_dropped_by_reason=dict(self.updates_dropped_by_reason),
            update_delay_versions=self.update_delay_versions.copy(),
            replica_server_waits=dict(self.replica_server_waits),
            replica_promotions=self.replica_promotions,
            replica_divergence=dict(self.replica_divergence),
            replica_resyncing=dict(self.replica_resyncing),
            link_capacity=[(u, v, float(d["capacity"])) for u, v, d in state.graph.edges(data=True)],
            link_estimated=[(u, v, float(d["capacity"])) for u, v, d in estimated.edges(data=True)],
            link_in_flight=per_link(state.in_flight.values()),
            pending_updates=per_server(state.pending.values()),
            daemons_connected=len(state.daemons),
            jobs=len(state.jobs),
            codec_choices=dict(self.codec_choices),
        )
