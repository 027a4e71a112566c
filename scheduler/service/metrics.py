"""The scheduler's Prometheus metrics beyond the core's counters, and their HTTP endpoint.

Names follow the Prometheus conventions (base units, ``_total`` counters, ``_seconds``,
``_bytes``); all start with ``mlfabric_``. Besides the counters of
:class:`~mlfabric.scheduler.service.core.Metrics` (ready, applied, dropped, released,
``mlfabric_decision_seconds``), :class:`ServiceCollector` reports at each scrape:

- ``mlfabric_link_capacity_bytes_per_second{src,dst}``: configured rate of each directed link
- ``mlfabric_link_estimated_bytes_per_second{src,dst}``: the estimator's residual bandwidth
- ``mlfabric_link_in_flight_transfers{src,dst}``: released transfers crossing the link
- ``mlfabric_link_scheduled_bytes_total{src,dst}``: bytes of the transfers released over the
  link (with :class:`~.admin.ObservedState`, the service's state)
- ``mlfabric_pending_updates{job,server}``: updates ready and not yet released
- ``mlfabric_daemons_connected``, ``mlfabric_jobs``
- ``mlfabric_updates_resolved_total{outcome}``: APPLIED / DROPPED (``applied``/``dropped``)
- ``mlfabric_updates_dropped_by_reason_total{reason}``: the drop reason without its
  names and numbers (``delay > tau_max``), so the label set stays small
- ``mlfabric_update_delay_versions``: histogram of the delay (server versions, paper §3)
  of applied updates

and :class:`MeteredEstimator` (wrapping the bandwidth estimator, which sees every measured
transfer) counts ``mlfabric_link_transferred_bytes_total{src,dst}`` and the transfer
completion times ``mlfabric_transfer_duration_seconds``.

The collector reads the service state, which the asyncio loop mutates: :func:`serve_metrics`
(a minimal HTTP/1.0 server on that loop) has it copy the state on the loop, then formats
the text in a thread (measured on a k=16 fat tree, 1,024 hosts and 6,144 links: the copy
holds the loop a few ms; formatting takes ~0.3 s).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

__all__ = ["DELAY_BUCKETS", "MeteredEstimator", "ServiceCollector", "drop_reason_class", "serve_metrics"]

#: buckets of the update-delay histogram, in server versions
DELAY_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64)


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


@dataclass(frozen=True)
class _Snapshot:
    """What one scrape reports, copied from the state on the service's loop."""

    capacity: list[tuple[str, str, float]]
    estimated: list[tuple[str, str, float]]
    crossing: dict[tuple[str, str], int]
    pending: dict[tuple[str, str], int]
    daemons: int
    jobs: int
    scheduled: dict[tuple[str, str], int] | None
    resolved: dict[str, int]
    reasons: dict[str, int]
    delays: list[int]
    delay_sum: float


class ServiceCollector(Collector):
    """Gauges and outcome counters of a :class:`SchedulerCore`.

    :meth:`refresh` copies what a scrape reports from the state (a few ms for thousands
    of links) and must run where the state is mutated, on the service's loop; building
    the families and their text (hundreds of ms for thousands of links) may then run in a
    thread (:func:`serve_metrics`). With ``refresh_on_collect`` every :meth:`collect`
    refreshes first (for a state no other thread mutates: tests, tools).

    Outcomes are counted incrementally: each refresh walks back the outcomes the state
    recorded (in order) down to the newest one counted by the previous refresh, so the
    counters never go down. An update whose outcome is recorded again counts again.

    Parameters
    ----------
    core : SchedulerCore
        The running service (its ``state`` and ``estimator`` are read).
    refresh_on_collect : bool
        Refresh at every :meth:`collect`.
    """

    def __init__(self, core: Any, refresh_on_collect: bool = True) -> None:
        self._core = core
        self._refresh_on_collect = refresh_on_collect
        self._snapshot: _Snapshot | None = None
        self._last: Any = None  # the newest outcome counted (recording one makes a new object)
        self._resolved: dict[str, int] = {"applied": 0, "dropped": 0}
        self._reasons: dict[str, int] = {}
        self._delays = [0] * (len(DELAY_BUCKETS) + 1)
        self._delay_sum = 0.0

    def _count_outcomes(self) -> None:
        new = []
        for o in reversed(self._core.state.outcomes.values()):
            if o is self._last:
                break
            new.append(o)
        if new:
            self._last = new[0]
        for o in reversed(new):
            kind = o.kind.name.lower()
            self._resolved[kind] = self._resolved.get(kind, 0) + 1
            if kind == "dropped":
                cls = drop_reason_class(o.reason)
                self._reasons[cls] = self._reasons.get(cls, 0) + 1
            elif o.delay is not None:
                i = next((i for i, b in enumerate(DELAY_BUCKETS) if o.delay <= b), len(DELAY_BUCKETS))
                self._delays[i] += 1
                self._delay_sum += o.delay

    def refresh(self) -> None:
        """Copy what the next scrape reports from the state (run on the service's loop)."""
        state = self._core.state
        crossing: dict[tuple[str, str], int] = {}
        for f in state.in_flight.values():
            for link in pairwise(f.path):
                crossing[link] = crossing.get(link, 0) + 1
        per_server: dict[tuple[str, str], int] = {}
        for p in state.pending.values():
            per_server[(p.job, p.server)] = per_server.get((p.job, p.server), 0) + 1
        activity = getattr(state, "activity", None)  # an ObservedState (the service's)
        self._count_outcomes()
        self._snapshot = _Snapshot(
            capacity=[(u, v, float(d["capacity"])) for u, v, d in state.graph.edges(data=True)],
            estimated=[
                (u, v, float(d["capacity"]))
                for u, v, d in self._core.estimator.estimated_graph().edges(data=True)
            ],
            crossing=crossing,
            pending=per_server,
            daemons=len(state.daemons),
            jobs=len(state.jobs),
            scheduled=None if activity is None else dict(activity.scheduled),
            resolved=dict(self._resolved),
            reasons=dict(self._reasons),
            delays=list(self._delays),
            delay_sum=self._delay_sum,
        )

    def collect(self) -> Iterator[Any]:
        """The metric families of the last :meth:`refresh` (called by the registry)."""
        if self._refresh_on_collect or self._snapshot is None:
            self.refresh()
        snap = self._snapshot
        assert snap is not None
        capacity = GaugeMetricFamily(
            "mlfabric_link_capacity_bytes_per_second",
            "configured rate of a directed link",
            labels=["src", "dst"],
        )
        for u, v, rate in snap.capacity:
            capacity.add_metric([u, v], rate)
        yield capacity
        estimated = GaugeMetricFamily(
            "mlfabric_link_estimated_bytes_per_second",
            "estimated residual bandwidth of a directed link",
            labels=["src", "dst"],
        )
        for u, v, rate in snap.estimated:
            estimated.add_metric([u, v], rate)
        yield estimated
        in_flight = GaugeMetricFamily(
            "mlfabric_link_in_flight_transfers", "released transfers crossing a link", labels=["src", "dst"]
        )
        for (u, v), n in sorted(snap.crossing.items()):
            in_flight.add_metric([u, v], n)
        yield in_flight
        pending = GaugeMetricFamily(
            "mlfabric_pending_updates", "updates ready and not yet released", labels=["job", "server"]
        )
        for (job, server), n in sorted(snap.pending.items()):
            pending.add_metric([job, server], n)
        yield pending
        yield GaugeMetricFamily("mlfabric_daemons_connected", "connected daemons", value=snap.daemons)
        yield GaugeMetricFamily("mlfabric_jobs", "jobs with a registered role", value=snap.jobs)
        if snap.scheduled is not None:
            scheduled = CounterMetricFamily(
                "mlfabric_link_scheduled_bytes",
                "bytes of the transfers released over a directed link",
                labels=["src", "dst"],
            )
            for (u, v), n in sorted(snap.scheduled.items()):
                scheduled.add_metric([u, v], n)
            yield scheduled
        resolved = CounterMetricFamily(
            "mlfabric_updates_resolved", "updates resolved, by outcome", labels=["outcome"]
        )
        for kind, n in sorted(snap.resolved.items()):
            resolved.add_metric([kind], n)
        yield resolved
        reasons = CounterMetricFamily(
            "mlfabric_updates_dropped_by_reason", "dropped updates, by reason class", labels=["reason"]
        )
        for cls, n in sorted(snap.reasons.items()):
            reasons.add_metric([cls], n)
        yield reasons
        cumulative, buckets = 0, []
        for bound, n in zip([*DELAY_BUCKETS, float("inf")], snap.delays, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
        yield HistogramMetricFamily(
            "mlfabric_update_delay_versions",
            "delay of applied updates in server versions (paper §3)",
            buckets=buckets,
            sum_value=snap.delay_sum,
        )


class MeteredEstimator:
    """A bandwidth estimator that also counts every measured transfer per link.

    Parameters
    ----------
    inner : Estimator
        The estimator the service uses (its answers are passed through unchanged).
    registry : CollectorRegistry
        Where ``mlfabric_link_transferred_bytes_total`` and
        ``mlfabric_transfer_duration_seconds`` are registered.
    activity : Activity, optional
        Also noted there (:mod:`.admin`: link utilisation for ``mlfabric status``).

    Examples
    --------
    >>> from prometheus_client import CollectorRegistry
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.core import StaticEstimator
    >>> r = CollectorRegistry()
    >>> e = MeteredEstimator(StaticEstimator(star(2, 8e9)), r)
    >>> e.observe(("h0", "sw", "h1"), 1000, 0.5, now=1.0)
    >>> r.get_sample_value("mlfabric_link_transferred_bytes_total", {"src": "h0", "dst": "sw"})
    1000.0
    """

    def __init__(self, inner: Any, registry: CollectorRegistry, activity: Any = None) -> None:
        self.inner = inner
        self._activity = activity
        self._bytes = Counter(
            "mlfabric_link_transferred_bytes",
            "bytes of measured transfers over a directed link",
            ["src", "dst"],
            registry=registry,
        )
        self._duration = Histogram(
            "mlfabric_transfer_duration_seconds",
            "completion time of one transfer (sender's start to end)",
            buckets=(1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0),
            registry=registry,
        )

    def observe(
        self, path: Sequence[str], nbytes: int, duration: float, now: float, *, shared: int = 1
    ) -> None:
        """Count the transfer, then pass the measurement on."""
        for u, v in pairwise(path):
            self._bytes.labels(u, v).inc(nbytes)
        self._duration.observe(duration)
        if self._activity is not None:
            self._activity.transfer(path, nbytes, now)
        self.inner.observe(path, nbytes, duration, now, shared=shared)

    def estimated_graph(self) -> Any:
        """The inner estimator's graph."""
        return self.inner.estimated_graph()


async def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, before: Callable[[], None] | None = None
) -> asyncio.Server:
    """Serve ``GET /metrics`` (the registry's text exposition) from the running loop.

    Every other path answers 404. For each scrape ``before()`` runs on the loop (where
    :meth:`ServiceCollector.refresh` copies the state, between the service's own
    callbacks, without locks), then the text is built in a thread, so a scrape of a
    large cluster holds the loop only for the copy.

    Raises
    ------
    OSError
        The address cannot be bound.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        parts = request.split(b" ", 2)
        path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
        if parts[0] in (b"GET", b"HEAD") and path in (b"/metrics", b"/"):
            if before is not None:
                before()
            body = await asyncio.to_thread(generate_latest, registry)
            status, ctype = b"200 OK", CONTENT_TYPE_LATEST.encode()
        else:
            body, status, ctype = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
        head = b"HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, ctype, len(body))
        try:
            writer.write(head + (b"" if parts[0] == b"HEAD" else body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
