"""The scheduler's Prometheus metrics and their HTTP endpoint.

One collector per process: :class:`ServiceCollector` reads a
:class:`~mlfabric.scheduler.service.observe.ServiceStats` snapshot (``SchedulerCore.stats()``:
the counters the service's :class:`~mlfabric.scheduler.service.observe.Recorder` kept and the
gauges of its state) and turns it into metric families, as client_python's custom collectors
do. Names follow the Prometheus conventions (base units, ``_total`` counters, ``_seconds``,
``_bytes``); all start with ``mlfabric_``:

- ``mlfabric_updates_ready_total``, ``mlfabric_updates_applied_total``,
  ``mlfabric_updates_dropped_total``, ``mlfabric_updates_unknown_total``: update-ready
  notifications and the verdicts the core passed on, one per push (worker update);
  ``mlfabric_transfers_released_total``:
  send directives; ``mlfabric_decision_seconds``: histogram of one policy decision's time
- ``mlfabric_link_capacity_bytes_per_second{src,dst}``: configured rate of each directed link
- ``mlfabric_link_estimated_bytes_per_second{src,dst}``: the estimator's residual bandwidth
- ``mlfabric_link_in_flight_transfers{src,dst}``: released transfers crossing the link
- ``mlfabric_link_scheduled_bytes_total{src,dst}``: bytes of the transfers released over the link
- ``mlfabric_link_transferred_bytes_total{src,dst}``: bytes of measured transfers over the
  link; ``mlfabric_transfer_duration_seconds``: histogram of their completion times
- ``mlfabric_pending_updates{job,server}``: updates ready and not yet released
- ``mlfabric_daemons_connected``, ``mlfabric_jobs``
- ``mlfabric_updates_resolved_total{outcome}``: outcomes recorded (``applied``/``dropped``/``unknown``):
  every push's and, with aggregation (``stf+agg``, ``stf+tree``), every aggregate's own (the
  sum the server applied or dropped), so ``{outcome="applied"}`` exceeds
  ``mlfabric_updates_applied_total`` by the aggregates applied; count pushes with the latter
- ``mlfabric_updates_dropped_by_reason_total{reason}``: the drop reason without its
  names and numbers (``delay > tau_max``), so the label set stays small
- ``mlfabric_update_delay_versions``: histogram of the delay (server versions, paper §3)
  of applied updates
- ``mlfabric_replica_server_waits_total{job,server}``, ``mlfabric_replica_divergence{job,server}``,
  ``mlfabric_replica_resyncing{job,server}``, ``mlfabric_replica_promotions_total``
  (docs/replication.md)
- ``mlfabric_codec_choices_total{codec}``: codecs the scheduler chose for a worker host's
  pushes to a server (``auto``, docs/compression.md), one per change, by codec (``none``,
  ``fp16``, ``bf16``, ``int8``)

The snapshot copies what the asyncio loop mutates: :func:`serve_metrics` (a minimal HTTP/1.0
server on that loop) has the collector take it on the loop, then formats the text in a thread
(measured on a k=16 fat tree, 1,024 hosts and 6,144 links: the copy holds the loop a few ms;
formatting takes ~0.3 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mlfabric.scheduler.service.observe import Buckets, ServiceStats

__all__ = ["ServiceCollector", "serve_metrics"]


def _labelled(
    family: CounterMetricFamily | GaugeMetricFamily, values: Mapping[tuple[str, str], float]
) -> CounterMetricFamily | GaugeMetricFamily:
    """``family`` with one sample per (two-label) key of ``values``, in key order."""
    for labels, value in sorted(values.items()):
        family.add_metric(list(labels), value)
    return family


def _histogram(
    name: str, documentation: str, b: Buckets, label: Callable[[float], str]
) -> HistogramMetricFamily:
    """The histogram family of ``b``, each bucket's bound written by ``label``."""
    buckets = [(label(bound), n) for bound, n in b.cumulative()]
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=b.sum)


class ServiceCollector(Collector):
    """Every metric of the scheduler, from the snapshot ``stats()`` returns (see the module docstring).

    :meth:`refresh` takes the snapshot (a few ms for thousands of links) and must run where
    the state is mutated, on the service's loop; building the families and their text
    (hundreds of ms for thousands of links) may then run in a thread (:func:`serve_metrics`).
    With ``refresh_on_collect`` every :meth:`collect` refreshes first (for a service no other
    thread runs: tests, tools).

    Parameters
    ----------
    stats : callable
        ``stats()`` -> :class:`~mlfabric.scheduler.service.observe.ServiceStats`
        (``SchedulerCore.stats``).
    refresh_on_collect : bool
        Refresh at every :meth:`collect`.

    Examples
    --------
    >>> from prometheus_client import CollectorRegistry
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.state import SchedulerState
    >>> s = SchedulerState(star(2, 8e9))
    >>> r = CollectorRegistry()
    >>> r.register(ServiceCollector(lambda: s.recorder.stats(s, s.graph)))
    >>> r.get_sample_value("mlfabric_link_capacity_bytes_per_second", {"src": "h0", "dst": "sw"})
    1000000000.0
    >>> r.get_sample_value("mlfabric_updates_ready_total")
    0
    """

    def __init__(self, stats: Callable[[], ServiceStats], refresh_on_collect: bool = True) -> None:
        self._stats = stats
        self._refresh_on_collect = refresh_on_collect
        self._snapshot: ServiceStats | None = None

    def refresh(self) -> None:
        """Take the snapshot the next scrape reports (run on the service's loop)."""
        self._snapshot = self._stats()

    def collect(self) -> Iterator[Metric]:
        """The metric families of the last :meth:`refresh` (called by the registry)."""
        if self._refresh_on_collect or self._snapshot is None:
            self.refresh()
        snap = self._snapshot
        assert snap is not None
        yield CounterMetricFamily(
            "mlfabric_updates_ready", "update-ready notifications", value=snap.updates_ready
        )
        yield CounterMetricFamily(
            "mlfabric_updates_applied", "updates applied at servers", value=snap.updates_applied
        )
        yield CounterMetricFamily("mlfabric_updates_dropped", "updates dropped", value=snap.updates_dropped)
        yield CounterMetricFamily(
            "mlfabric_updates_unknown",
            "updates whose application cannot be known",
            value=snap.updates_unknown,
        )
        yield CounterMetricFamily(
            "mlfabric_transfers_released", "send directives", value=snap.transfers_released
        )
        yield _histogram(
            "mlfabric_decision_seconds", "time of one policy decision", snap.decision_seconds, floatToGoString
        )
        capacity = GaugeMetricFamily(
            "mlfabric_link_capacity_bytes_per_second",
            "configured rate of a directed link",
            labels=["src", "dst"],
        )
        for u, v, rate in snap.link_capacity:
            capacity.add_metric([u, v], rate)
        yield capacity
        estimated = GaugeMetricFamily(
            "mlfabric_link_estimated_bytes_per_second",
            "estimated residual bandwidth of a directed link",
            labels=["src", "dst"],
        )
        for u, v, rate in snap.link_estimated:
            estimated.add_metric([u, v], rate)
        yield estimated
        yield _labelled(
            GaugeMetricFamily(
                "mlfabric_link_in_flight_transfers",
                "released transfers crossing a link",
                labels=["src", "dst"],
            ),
            snap.link_in_flight,
        )
        yield _labelled(
            GaugeMetricFamily(
                "mlfabric_pending_updates", "updates ready and not yet released", labels=["job", "server"]
            ),
            snap.pending_updates,
        )
        yield GaugeMetricFamily(
            "mlfabric_daemons_connected", "connected daemons", value=snap.daemons_connected
        )
        yield GaugeMetricFamily("mlfabric_jobs", "jobs with a registered role", value=snap.jobs)
        yield _labelled(
            CounterMetricFamily(
                "mlfabric_link_scheduled_bytes",
                "bytes of the transfers released over a directed link",
                labels=["src", "dst"],
            ),
            snap.link_scheduled_bytes,
        )
        yield _labelled(
            CounterMetricFamily(
                "mlfabric_link_transferred_bytes",
                "bytes of measured transfers over a directed link",
                labels=["src", "dst"],
            ),
            snap.link_transferred_bytes,
        )
        yield _histogram(
            "mlfabric_transfer_duration_seconds",
            "completion time of one transfer (sender's start to end)",
            snap.transfer_duration_seconds,
            floatToGoString,
        )
        resolved = CounterMetricFamily(
            "mlfabric_updates_resolved", "updates resolved, by outcome", labels=["outcome"]
        )
        for kind, n in sorted(snap.updates_resolved.items()):
            resolved.add_metric([kind], n)
        yield resolved
        reasons = CounterMetricFamily(
            "mlfabric_updates_dropped_by_reason", "dropped updates, by reason class", labels=["reason"]
        )
        for cls, n in sorted(snap.updates_dropped_by_reason.items()):
            reasons.add_metric([cls], n)
        yield reasons
        yield _histogram(
            "mlfabric_update_delay_versions",
            "delay of applied updates in server versions (paper §3)",
            snap.update_delay_versions,
            lambda bound: "+Inf" if bound == float("inf") else f"{bound:g}",
        )
        yield _labelled(
            CounterMetricFamily(
                "mlfabric_replica_server_waits",
                "times a server waited for its replica (applying would have broken div_max)",
                labels=["job", "server"],
            ),
            snap.replica_server_waits,
        )
        yield _labelled(
            GaugeMetricFamily(
                "mlfabric_replica_divergence",
                "sum of the norms applied at a server and not yet at its replica",
                labels=["job", "server"],
            ),
            snap.replica_divergence,
        )
        yield _labelled(
            GaugeMetricFamily(
                "mlfabric_replica_resyncing",
                "1 while a replica registered again after it was detached is being re-synced (sent the "
                "model again; not promotable, its server does not wait on it), else 0",
                labels=["job", "server"],
            ),
            snap.replica_resyncing,
        )
        yield CounterMetricFamily(
            "mlfabric_replica_promotions",
            "replicas promoted to server after a failure",
            value=snap.replica_promotions,
        )
        yield _labelled(
            CounterMetricFamily(
                "mlfabric_allreduce_plans",
                "all-reduce plans made, by executor (daemons, process_group) and kind (tree, ring, native: "
                "the process group's own collective)",
                labels=["executor", "kind"],
            ),
            snap.allreduce_plans,
        )
        choices = CounterMetricFamily(
            "mlfabric_codec_choices",
            "codecs chosen for a worker host's pushes to a server (auto; one per change), by codec",
            labels=["codec"],
        )
        for codec, count in sorted(snap.codec_choices.items()):
            choices.add_metric([codec], count)
        yield choices


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
