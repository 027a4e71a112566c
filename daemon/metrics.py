"""A daemon's Prometheus metrics (``mlfabric daemon --metrics-port P``).

Names follow the Prometheus conventions; every series carries the daemon's host in the
``host`` label so one dashboard query covers the cluster:

- ``mlfabric_daemon_sent_bytes_total{host,dst}``: payload bytes of successful transfers
  to a next hop (from the transfer reports the daemon sends to the scheduler)
- ``mlfabric_daemon_transfers_total{host,result}``: transfers by result: ``ok`` or ``failed``
- ``mlfabric_daemon_dataplane_errors_total{host}``: transfers that failed on the data plane
  (connection refused or reset, timeout, refused frame); each retry that fails counts
- ``mlfabric_daemon_updates_resolved_total{host,outcome}``: pushes to a server answered
  APPLIED or DROPPED (``outcome`` ``applied``/``dropped``)
- ``mlfabric_daemon_received_bytes_total{host,src}``: payload bytes of data-plane frames
  received from a peer host
- ``mlfabric_daemon_received_frames_total{host}``
- ``mlfabric_daemon_local_clients{host}``: training processes registered on the local API
- ``mlfabric_daemon_aggregate_members_total{host}``: worker updates received here to be summed
  into an aggregate (this host an aggregator hop, paper Fig. 6), and
  ``mlfabric_daemon_aggregate_member_bytes_total{host}`` their payload bytes
- ``mlfabric_daemon_aggregates_sent_total{host,result}``: aggregates forwarded by this host
- ``mlfabric_daemon_fallback_active{host}``: 1 while the daemon sends directly because the
  scheduler is unreachable (``--fallback-after``), and
  ``mlfabric_daemon_unannounced_pushes{host}``: pushes no scheduler session knows
- ``mlfabric_daemon_inflight_bytes{host,budget}``: payload bytes held against the ``push`` and
  ``receive`` budgets (``--max-inflight-bytes``), and ``mlfabric_daemon_pool_idle_bytes{host}``:
  released receive buffers kept for reuse

:class:`MeteredDaemon` is the :class:`~mlfabric.daemon.host.Daemon` with these counts; a
daemon started without ``--metrics-port`` is the plain one.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from mlfabric.daemon.host import Daemon
from mlfabric.daemon.reports import TransferReportLog
from mlfabric.daemon.roles.aggregator.role import AGGREGATE_PREFIX as _AGGREGATE_PREFIX
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

__all__ = ["DaemonMetrics", "MeteredDaemon", "MeteredReportLog"]

_OUTCOMES = {control_pb2.OUTCOME_APPLIED: "applied", control_pb2.OUTCOME_DROPPED: "dropped"}


class DaemonMetrics:
    """The counters of one daemon, in their own registry.

    Examples
    --------
    >>> from mlfabric.proto.v1 import control_pb2
    >>> m = DaemonMetrics("w0")
    >>> m.report(control_pb2.TransferReport(dst_host="ps", bytes=512, ok=True))
    >>> m.registry.get_sample_value("mlfabric_daemon_sent_bytes_total", {"host": "w0", "dst": "ps"})
    512.0
    """

    def __init__(self, host: str, registry: CollectorRegistry | None = None) -> None:
        self.host = host
        self.registry = CollectorRegistry() if registry is None else registry
        r = self.registry
        self.sent_bytes = Counter(
            "mlfabric_daemon_sent_bytes", "payload bytes sent to a next hop", ["host", "dst"], registry=r
        )
        self.transfers = Counter(
            "mlfabric_daemon_transfers", "transfers by result", ["host", "result"], registry=r
        )
        self.errors = Counter(
            "mlfabric_daemon_dataplane_errors", "transfers failed on the data plane", ["host"], registry=r
        )
        self.resolved = Counter(
            "mlfabric_daemon_updates_resolved",
            "pushes answered by the server, by outcome",
            ["host", "outcome"],
            registry=r,
        )
        self.received_bytes = Counter(
            "mlfabric_daemon_received_bytes",
            "payload bytes received from a peer",
            ["host", "src"],
            registry=r,
        )
        self.received_frames = Counter(
            "mlfabric_daemon_received_frames", "data-plane frames received", ["host"], registry=r
        )
        self.local_clients = Gauge(
            "mlfabric_daemon_local_clients",
            "training processes registered on the local API",
            ["host"],
            registry=r,
        )
        self.aggregate_members = Counter(
            "mlfabric_daemon_aggregate_members",
            "worker updates received to be summed here",
            ["host"],
            registry=r,
        )
        self.aggregate_member_bytes = Counter(
            "mlfabric_daemon_aggregate_member_bytes", "payload bytes of those updates", ["host"], registry=r
        )
        self.aggregates_sent = Counter(
            "mlfabric_daemon_aggregates_sent",
            "aggregates forwarded, by result",
            ["host", "result"],
            registry=r,
        )
        # the label sets that always exist, so a dashboard sees zeros rather than no series
        self.aggregate_members.labels(host)
        self.aggregate_member_bytes.labels(host)
        for result in ("ok", "failed"):
            self.transfers.labels(host, result)
        for outcome in _OUTCOMES.values():
            self.resolved.labels(host, outcome)
        self.errors.labels(host)
        self.received_frames.labels(host)

    def report(self, report: Any) -> None:
        """Count one ``TransferReport`` the daemon sends to the scheduler."""
        if report.update_id.startswith(_AGGREGATE_PREFIX):
            self.aggregates_sent.labels(self.host, "ok" if report.ok else "failed").inc()
        if report.ok:
            self.transfers.labels(self.host, "ok").inc()
            self.sent_bytes.labels(self.host, report.dst_host).inc(report.bytes)
        else:
            self.transfers.labels(self.host, "failed").inc()
            self.errors.labels(self.host).inc()
        outcome = _OUTCOMES.get(report.outcome)
        if outcome is not None:
            self.resolved.labels(self.host, outcome).inc()

    def frame(self, header: Any) -> None:
        """Count one received data-plane frame."""
        self.received_frames.labels(self.host).inc()
        if (
            header.kind == dataplane_pb2.FRAME_KIND_UPDATE
            and header.aggregate_id
            and (header.update_id != header.aggregate_id)
        ):
            self.aggregate_members.labels(self.host).inc()
            self.aggregate_member_bytes.labels(self.host).inc(header.payload_bytes)
        if header.payload_bytes:
            self.received_bytes.labels(self.host, header.src_host or "unknown").inc(header.payload_bytes)


class MeteredReportLog(TransferReportLog):
    """The daemon's report sink: counts every report, and appends it to a file when given one.

    Parameters
    ----------
    metrics : DaemonMetrics
    path : str, optional
        The ``--report-file`` (None: count only).
    """

    def __init__(self, metrics: DaemonMetrics, path: str | None = None) -> None:
        super().__init__(path or "")
        self.metrics = metrics
        self._writes = path is not None

    def start(self) -> None:
        """Open the report file, if any."""
        if self._writes:
            super().start()

    def stop(self) -> None:
        """Close the report file, if any."""
        if self._writes:
            super().stop()

    def write(self, report: Any) -> None:
        """Count ``report``; append it to the file, if any."""
        self.metrics.report(report)
        if self._writes:
            super().write(report)


class MeteredDaemon(Daemon):
    """A :class:`Daemon` that counts its received frames and local clients in ``metrics``.

    Parameters
    ----------
    config : DaemonConfig
    metrics : DaemonMetrics
    report_file : str, optional
        Also append every transfer report to this file (``--report-file``).
    **kwargs
        Passed to :class:`Daemon`.
    """

    def __init__(
        self, config: Any, metrics: DaemonMetrics, report_file: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(config, report_log=MeteredReportLog(metrics, report_file), **kwargs)
        self.metrics = metrics
        metrics.local_clients.labels(config.host).set_function(lambda: len(self._roles))
        r, host = metrics.registry, config.host
        active = Gauge("mlfabric_daemon_fallback_active", "1 while sending directly", ["host"], registry=r)
        active.labels(host).set_function(lambda: float(self.fallback.active))
        unannounced = Gauge(
            "mlfabric_daemon_unannounced_pushes", "pushes no scheduler session knows", ["host"], registry=r
        )
        unannounced.labels(host).set_function(self.fallback.unannounced)
        inflight = Gauge(
            "mlfabric_daemon_inflight_bytes", "payload bytes held, by budget", ["host", "budget"], registry=r
        )
        inflight.labels(host, "push").set_function(lambda: self.push_budget.in_use)
        inflight.labels(host, "receive").set_function(lambda: self.receive_budget.in_use)
        idle = Gauge(
            "mlfabric_daemon_pool_idle_bytes", "receive buffers kept for reuse", ["host"], registry=r
        )
        idle.labels(host).set_function(lambda: self.receive_buffers.idle_bytes)

    def _on_frame(self, frame: Any) -> Any:
        self.metrics.frame(frame.header)
        return super()._on_frame(frame)
