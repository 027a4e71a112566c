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
therefore answers scrapes on that loop (a minimal HTTP/1.0 server), never from a thread.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Sequence
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


class ServiceCollector(Collector):
    """Gauges and outcome counters read from a :class:`SchedulerCore` at scrape time.

    Outcomes are counted incrementally: each scrape walks back the outcomes the state
    recorded (in order) down to the newest one counted by the previous scrape, so the
    counters never go down. An update whose outcome is recorded again counts again.

    Parameters
    ----------
    core : SchedulerCore
        The running service (its ``state`` and ``estimator`` are read).
    """

    def __init__(self, core: Any) -> None:
        self._core = core
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

    def collect(self) -> Iterator[Any]:
        """The metric families (called by the registry at each scrape)."""
        state = self._core.state
        capacity = GaugeMetricFamily(
            "mlfabric_link_capacity_bytes_per_second",
            "configured rate of a directed link",
            labels=["src", "dst"],
        )
        for u, v, d in state.graph.edges(data=True):
            capacity.add_metric([u, v], float(d["capacity"]))
        yield capacity
        estimated = GaugeMetricFamily(
            "mlfabric_link_estimated_bytes_per_second",
            "estimated residual bandwidth of a directed link",
            labels=["src", "dst"],
        )
        for u, v, d in self._core.estimator.estimated_graph().edges(data=True):
            estimated.add_metric([u, v], float(d["capacity"]))
        yield estimated
        crossing: dict[tuple[str, str], int] = {}
        for f in list(state.in_flight.values()):
            for link in pairwise(f.path):
                crossing[link] = crossing.get(link, 0) + 1
        in_flight = GaugeMetricFamily(
            "mlfabric_link_in_flight_transfers", "released transfers crossing a link", labels=["src", "dst"]
        )
        for (u, v), n in sorted(crossing.items()):
            in_flight.add_metric([u, v], n)
        yield in_flight
        per_server: dict[tuple[str, str], int] = {}
        for p in list(state.pending.values()):
            per_server[(p.job, p.server)] = per_server.get((p.job, p.server), 0) + 1
        pending = GaugeMetricFamily(
            "mlfabric_pending_updates", "updates ready and not yet released", labels=["job", "server"]
        )
        for (job, server), n in sorted(per_server.items()):
            pending.add_metric([job, server], n)
        yield pending
        yield GaugeMetricFamily("mlfabric_daemons_connected", "connected daemons", value=len(state.daemons))
        yield GaugeMetricFamily("mlfabric_jobs", "jobs with a registered role", value=len(state.jobs))

        activity = getattr(state, "activity", None)  # an ObservedState (the service's)
        if activity is not None:
            scheduled = CounterMetricFamily(
                "mlfabric_link_scheduled_bytes",
                "bytes of the transfers released over a directed link",
                labels=["src", "dst"],
            )
            for (u, v), n in sorted(activity.scheduled.items()):
                scheduled.add_metric([u, v], n)
            yield scheduled
        self._count_outcomes()
        resolved = CounterMetricFamily(
            "mlfabric_updates_resolved", "updates resolved, by outcome", labels=["outcome"]
        )
        for kind, n in sorted(self._resolved.items()):
            resolved.add_metric([kind], n)
        yield resolved
        reasons = CounterMetricFamily(
            "mlfabric_updates_dropped_by_reason", "dropped updates, by reason class", labels=["reason"]
        )
        for cls, n in sorted(self._reasons.items()):
            reasons.add_metric([cls], n)
        yield reasons
        cumulative, buckets = 0, []
        for bound, n in zip([*DELAY_BUCKETS, float("inf")], self._delays, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
        yield HistogramMetricFamily(
            "mlfabric_update_delay_versions",
            "delay of applied updates in server versions (paper §3)",
            buckets=buckets,
            sum_value=self._delay_sum,
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


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """Serve ``GET /metrics`` (the registry's text exposition) on the running loop.

    Every other path answers 404. Scrapes run on the loop, between the service's own
    callbacks, so collectors read the state without locks.

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
            body, status, ctype = generate_latest(registry), b"200 OK", CONTENT_TYPE_LATEST.encode()
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
