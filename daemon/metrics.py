"""A daemon's Prometheus metrics (``mlfabric daemon --metrics-port P``): one collector over its stats.

:class:`DaemonCollector` is a custom collector (prometheus client_python's pattern): at every
scrape its :meth:`~DaemonCollector.collect` reads one snapshot,
:meth:`~mlfabric.daemon.host.Daemon.stats`, and reports it. Nothing wraps or subclasses the
daemon to count. Names follow the Prometheus conventions; every series carries the daemon's
host in the ``host`` label so one dashboard query covers the cluster:

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
- ``mlfabric_daemon_model_gets_total{host,what}``: model gets by how they were answered or
  fetched (``local_hits``, ``peer_hits``, ``fetches``, ``joined``, ``relay_fallbacks``,
  ``server_gets``, ``relayed``, ``not_kept``; docs/model-relays.md), and
  ``mlfabric_daemon_model_cache_bytes{host}``: bytes of the models kept in the cache
- ``mlfabric_daemon_pushes_total{host,codec}``: pushes taken from this host's training
  processes by codec (``none``, ``fp16``, ``bf16``, ``int8``, ``topk``, ``randk``; docs/compression.md), with
  ``mlfabric_daemon_push_bytes_total{host,codec}`` their payload bytes (on the wire) and
  ``mlfabric_daemon_push_raw_bytes_total{host,codec}`` their tensors' bytes uncompressed
- ``mlfabric_daemon_update_bytes_received_total{host,codec}`` and
  ``mlfabric_daemon_update_raw_bytes_received_total{host,codec}``: the same for the UPDATE
  frames (updates and aggregates) received here: an aggregator hop's or a server's ingress
- ``mlfabric_daemon_model_bytes_served_total{host,codec}`` and
  ``mlfabric_daemon_model_raw_bytes_served_total{host,codec}``: the MODEL frames (whole models
  and pieces) sent to peers, by the model's codec (``none``, ``fp16``, ``bf16``;
  ``Params(model_compression=)``): a server's or a relay's egress
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlfabric.daemon.stats import DaemonStats

__all__ = ["DaemonCollector"]


def _family(
    kind: type, name: str, doc: str, labels: list[str], values: Mapping[str, float] | float, host: str
) -> Any:
    """A metric family of ``kind``: one sample per label value of ``values`` (or one, unlabelled)."""
    family = kind(name, doc, labels=["host", *labels])
    if isinstance(values, Mapping):
        for label, value in sorted(values.items()):
            family.add_metric([host, label], float(value))
    else:
        family.add_metric([host], float(values))
    return family


class DaemonCollector(Collector):
    """Reports a daemon's :class:`~mlfabric.daemon.stats.DaemonStats` at every scrape.

    Parameters
    ----------
    stats : callable
        ``stats() -> DaemonStats`` (the daemon's :meth:`~mlfabric.daemon.host.Daemon.stats`).

    Examples
    --------
    >>> from prometheus_client import CollectorRegistry
    >>> from mlfabric.daemon.stats import DaemonStats
    >>> registry = CollectorRegistry()
    >>> registry.register(DaemonCollector(lambda: DaemonStats("w0", sent_bytes={"ps": 512})))
    >>> registry.get_sample_value("mlfabric_daemon_sent_bytes_total", {"host": "w0", "dst": "ps"})
    512.0
    """

    def __init__(self, stats: Callable[[], DaemonStats]) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Any]:
        """The families (without samples), so registering reads no stats."""
        yield from self._families(DaemonStats(""), samples=False)

    def collect(self) -> Iterator[Any]:
        """The families of one snapshot."""
        yield from self._families(self._stats(), samples=True)

    def _families(self, s: DaemonStats, *, samples: bool) -> Iterator[Any]:
        C, G = CounterMetricFamily, GaugeMetricFamily
        rows: list[tuple[type, str, str, list[str], Any]] = [
            (C, "mlfabric_daemon_sent_bytes", "payload bytes sent to a next hop", ["dst"], s.sent_bytes),
            (C, "mlfabric_daemon_transfers", "transfers by result", ["result"], s.transfers),
            (
                C,
                "mlfabric_daemon_dataplane_errors",
                "transfers failed on the data plane",
                [],
                s.dataplane_errors,
            ),
            (
                C,
                "mlfabric_daemon_updates_resolved",
                "pushes answered by the server, by outcome",
                ["outcome"],
                s.resolved,
            ),
            (
                C,
                "mlfabric_daemon_received_bytes",
                "payload bytes received from a peer",
                ["src"],
                s.received_bytes,
            ),
            (C, "mlfabric_daemon_received_frames", "data-plane frames received", [], s.received_frames),
            (
                G,
                "mlfabric_daemon_local_clients",
                "training processes registered on the local API",
                [],
                s.local_clients,
            ),
            (
                C,
                "mlfabric_daemon_aggregate_members",
                "worker updates received to be summed here",
                [],
                s.aggregate_members,
            ),
            (
                C,
                "mlfabric_daemon_aggregate_member_bytes",
                "payload bytes of those updates",
                [],
                s.aggregate_member_bytes,
            ),
            (
                C,
                "mlfabric_daemon_aggregates_sent",
                "aggregates forwarded, by result",
                ["result"],
                s.aggregates_sent,
            ),
            (G, "mlfabric_daemon_fallback_active", "1 while sending directly", [], float(s.fallback_active)),
            (
                G,
                "mlfabric_daemon_unannounced_pushes",
                "pushes no scheduler session knows",
                [],
                s.unannounced_pushes,
            ),
            (
                G,
                "mlfabric_daemon_inflight_bytes",
                "payload bytes held, by budget",
                ["budget"],
                s.inflight_bytes,
            ),
            (G, "mlfabric_daemon_pool_idle_bytes", "receive buffers kept for reuse", [], s.pool_idle_bytes),
            (
                C,
                "mlfabric_daemon_model_gets",
                "model gets by how they were answered or fetched",
                ["what"],
                {k: v for k, v in s.models.items() if k not in ("entries", "bytes")},
            ),
            (
                G,
                "mlfabric_daemon_model_cache_bytes",
                "models kept in the cache",
                [],
                s.models.get("bytes", 0),
            ),
            (
                C,
                "mlfabric_daemon_pushes",
                "pushes from training processes, by codec",
                ["codec"],
                s.pushes,
            ),
            (C, "mlfabric_daemon_push_bytes", "their payload bytes (on the wire)", ["codec"], s.push_bytes),
            (
                C,
                "mlfabric_daemon_push_raw_bytes",
                "their tensors' bytes uncompressed",
                ["codec"],
                s.push_raw_bytes,
            ),
            (
                C,
                "mlfabric_daemon_update_bytes_received",
                "payload bytes of the updates and aggregates received, by codec",
                ["codec"],
                s.update_bytes_received,
            ),
            (
                C,
                "mlfabric_daemon_update_raw_bytes_received",
                "their tensors' bytes uncompressed",
                ["codec"],
                s.update_raw_bytes_received,
            ),
            (
                C,
                "mlfabric_daemon_model_bytes_served",
                "payload bytes of the models (and pieces) sent to peers, by codec",
                ["codec"],
                s.model_bytes_served,
            ),
            (
                C,
                "mlfabric_daemon_model_raw_bytes_served",
                "their tensors' bytes uncompressed",
                ["codec"],
                s.model_raw_bytes_served,
            ),
        ]
        for kind, name, doc, labels, values in rows:
            if samples:
                yield _family(kind, name, doc, labels, values, s.host)
            else:
                yield kind(name, doc, labels=["host", *labels])
