"""What a daemon counts, and the snapshot :meth:`~mlfabric.daemon.host.Daemon.stats` returns.

:class:`Counters` counts, as they happen, the transfer reports the daemon sends to the
scheduler and the data-plane frames it receives; :class:`DaemonStats` is one snapshot of those
counts and of the daemon's gauges (local clients, the fallback, the payload budgets, pooled
buffers). The Prometheus collector (:mod:`mlfabric.daemon.metrics`) reads a snapshot at every
scrape; nothing here knows Prometheus (docs/operations.md lists the metrics).
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlfabric.aggregators.codecs.payload import wire_summary
from mlfabric.daemon.channels.routing import FrameRoute, names_aggregate
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

__all__ = ["Counters", "DaemonStats", "LoadGauge", "cpu_load_per_core"]

_OUTCOMES = {control_pb2.OUTCOME_APPLIED: "applied", control_pb2.OUTCOME_DROPPED: "dropped"}
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_MODEL = dataplane_pb2.FRAME_KIND_MODEL


def cpu_load_per_core() -> float:
    """The host's 1-minute load average over the cores this process may run on (0: not known).

    What a daemon tells the scheduler with each update it announces (``UpdateReady.cpu_load``):
    the ``auto`` codec scales the codecs' one-core rates by it (docs/compression.md).

    Examples
    --------
    >>> cpu_load_per_core() >= 0
    True
    """
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 0.0
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return load / max(cores, 1)


class LoadGauge:
    """``read()`` at most once per ``interval`` seconds: the last value in between.

    The daemon stamps the host's load on every update it announces; the 1-minute load average
    moves slowly, so it is read from the kernel once a second, not per update.

    Examples
    --------
    >>> reads, now = iter([1.5, 2.5]), [0.0]
    >>> gauge = LoadGauge(lambda: next(reads), clock=lambda: now[0])
    >>> gauge(), gauge()
    (1.5, 1.5)
    >>> now[0] = 1.0
    >>> gauge()
    2.5
    """

    def __init__(
        self,
        read: Callable[[], float] = cpu_load_per_core,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = 1.0,
    ) -> None:
        self._read, self._clock, self._interval = read, clock, interval
        self._value, self._at = 0.0, -math.inf

    def __call__(self) -> float:
        now = self._clock()
        if now - self._at >= self._interval:
            self._value, self._at = float(self._read()), now
        return self._value


@dataclass(frozen=True)
class DaemonStats:
    """One daemon's counts and gauges at one moment.

    Attributes
    ----------
    host : str
        The daemon's host.
    sent_bytes : dict
        Next hop -> payload bytes of the transfers reported ok.
    transfers : dict
        ``"ok"``/``"failed"`` -> transfers reported.
    dataplane_errors : int
        Transfers reported failed (each failed forward or push counts).
    resolved : dict
        ``"applied"``/``"dropped"`` -> transfers reported with that outcome.
    aggregates_sent : dict
        ``"ok"``/``"failed"`` -> aggregates forwarded from here.
    received_bytes : dict
        Source host -> payload bytes of the frames received from it.
    received_frames : int
        Data-plane frames received.
    aggregate_members, aggregate_member_bytes : int
        Worker updates received here to be summed into an aggregate, and their payload bytes.
    local_clients : int
        Training processes registered on the local API.
    fallback_active : bool
        Whether the daemon sends directly because the scheduler is away.
    unannounced_pushes : int
        Pushes no scheduler session knows.
    inflight_bytes : dict
        ``"push"``/``"receive"`` -> payload bytes held against that budget.
    pool_idle_bytes : int
        Released receive buffers kept for reuse.
    models : dict
        The model gets (:meth:`~mlfabric.daemon.roles.relay.role.ModelRelays.stats`): cache
        hits, fetches sent upstream, relay fallbacks, GETs answered, the cache's size.
    pushes : dict
        Codec (``none``, ``fp16``, ``bf16``, ``int8``, ``topk``, ``randk``, ``mixed``;
        docs/compression.md) -> pushes this daemon took from its training processes.
    push_bytes, push_raw_bytes : dict
        Codec -> those pushes' payload bytes (what goes on the wire), and what their tensors
        take uncompressed.
    update_bytes_received, update_raw_bytes_received : dict
        Codec -> payload bytes of the UPDATE frames received (updates and aggregates, at an
        aggregator hop or a server's daemon), and what their tensors take uncompressed.
    model_bytes_served, model_raw_bytes_served : dict
        Codec (``none``, ``fp16``, ``bf16``; ``Params(model_compression=)``) -> payload bytes of
        the MODEL frames (whole models and pieces) this daemon sent to peers, and what those
        bytes take uncompressed (a piece: its share of the model's raw size, by its range).
    """

    host: str
    sent_bytes: dict[str, int] = field(default_factory=dict)
    transfers: dict[str, int] = field(default_factory=dict)
    dataplane_errors: int = 0
    resolved: dict[str, int] = field(default_factory=dict)
    aggregates_sent: dict[str, int] = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)
    received_frames: int = 0
    aggregate_members: int = 0
    aggregate_member_bytes: int = 0
    local_clients: int = 0
    fallback_active: bool = False
    unannounced_pushes: int = 0
    inflight_bytes: dict[str, int] = field(default_factory=dict)
    pool_idle_bytes: int = 0
    models: dict[str, int] = field(default_factory=dict)
    pushes: dict[str, int] = field(default_factory=dict)
    push_bytes: dict[str, int] = field(default_factory=dict)
    push_raw_bytes: dict[str, int] = field(default_factory=dict)
    update_bytes_received: dict[str, int] = field(default_factory=dict)
    update_raw_bytes_received: dict[str, int] = field(default_factory=dict)
    model_bytes_served: dict[str, int] = field(default_factory=dict)
    model_raw_bytes_served: dict[str, int] = field(default_factory=dict)


class Counters:
    """The daemon's counts of reports and frames (thread-safe).

    Examples
    --------
    >>> c = Counters()
    >>> c.report(control_pb2.TransferReport(update_id="w0/a/1", dst_host="ps", bytes=512, ok=True))
    >>> s = c.snapshot("w0")
    >>> s.sent_bytes, s.transfers
    ({'ps': 512}, {'ok': 1, 'failed': 0})
    >>> from mlfabric.tensors import Encoding, Layout
    >>> c.push([Layout("w", "float32", (256,), 0, 512, Encoding("fp16", "float16"))], 512)
    >>> s = c.snapshot("w0"); s.pushes, s.push_bytes, s.push_raw_bytes
    ({'fp16': 1}, {'fp16': 512}, {'fp16': 1024})
    >>> Header = dataplane_pb2.FrameHeader
    >>> first = Header(kind=_MODEL, job="j", server="ps", version=3, model_bytes=512)
    >>> t = first.tensors.add(name="w", dtype="float32", shape=[256], nbytes=512)
    >>> t.encoding.codec, t.encoding.words = "fp16", "float16"
    >>> rest = Header(kind=_MODEL, job="j", server="ps", version=3, range_offset=256, model_bytes=512)
    >>> c.model(first, 256); c.model(rest, 256)
    >>> s = c.snapshot("ps"); s.model_bytes_served, s.model_raw_bytes_served
    ({'fp16': 512}, {'fp16': 1024})
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent_bytes: collections.Counter[str] = collections.Counter()
        self._transfers = collections.Counter({"ok": 0, "failed": 0})
        self._errors = 0
        self._resolved = collections.Counter(dict.fromkeys(_OUTCOMES.values(), 0))
        self._aggregates_sent: collections.Counter[str] = collections.Counter()
        self._received_bytes: collections.Counter[str] = collections.Counter()
        self._frames = 0
        self._members = 0
        self._member_bytes = 0
        self._pushes: collections.Counter[str] = collections.Counter()
        self._push_bytes: collections.Counter[str] = collections.Counter()
        self._push_raw: collections.Counter[str] = collections.Counter()
        self._update_bytes: collections.Counter[str] = collections.Counter()
        self._update_raw: collections.Counter[str] = collections.Counter()
        self._model_bytes: collections.Counter[str] = collections.Counter()
        self._model_raw: collections.Counter[str] = collections.Counter()
        #: (job, server) -> (version, codec, raw bytes, wire bytes) of the model last served
        #: (the pieces after the first carry no layout)
        self._models: dict[tuple[str, str], tuple[int, str, int, int]] = {}

    def push(self, layouts: Any, payload_bytes: int) -> None:
        """Count one push taken from a training process (its tensors' layouts, its payload's size)."""
        codec, raw = wire_summary(layouts)
        with self._lock:
            self._pushes[codec] += 1
            self._push_bytes[codec] += payload_bytes
            self._push_raw[codec] += raw

    def report(self, report: Any) -> None:
        """Count one ``TransferReport`` the daemon sends to the scheduler."""
        result = "ok" if report.ok else "failed"
        outcome = _OUTCOMES.get(report.outcome)
        with self._lock:
            if names_aggregate(report.update_id):
                self._aggregates_sent[result] += 1
            self._transfers[result] += 1
            if report.ok:
                self._sent_bytes[report.dst_host] += report.bytes
            else:
                self._errors += 1
            if outcome is not None:
                self._resolved[outcome] += 1

    def frame(self, header: Any, route: FrameRoute) -> None:
        """Count one received data-plane frame (``route``: its :func:`~.channels.routing.frame_route`)."""
        with self._lock:
            self._frames += 1
            if route is FrameRoute.AGGREGATE_MEMBER:
                self._members += 1
                self._member_bytes += header.payload_bytes
            if header.payload_bytes:
                self._received_bytes[header.src_host or "unknown"] += header.payload_bytes
        if header.kind == _UPDATE and header.tensors and not header.HasField("allreduce"):
            codec, raw = wire_summary(header.tensors)
            with self._lock:
                self._update_bytes[codec] += header.payload_bytes
                self._update_raw[codec] += raw

    def model(self, header: Any, nbytes: int) -> None:
        """Count one MODEL frame sent to a peer: its header and its payload's ``nbytes``."""
        key = (str(header.job), str(header.server))
        with self._lock:
            if header.tensors:
                codec, raw = wire_summary(header.tensors)
                whole = int(header.model_bytes) or nbytes
                self._models[key] = (int(header.version), codec, raw, whole)
            known = self._models.get(key)
            if known is None or known[0] != header.version:
                codec, raw, whole = "none", nbytes, nbytes  # a piece of a model not seen: as raw
            else:
                _, codec, raw, whole = known
            self._model_bytes[codec] += nbytes
            if whole:  # a piece [start, end): its share of the raw size (the shares add up exactly)
                start = int(header.range_offset)
                self._model_raw[codec] += raw * (start + nbytes) // whole - raw * start // whole

    def snapshot(self, host: str, **gauges: Any) -> DaemonStats:
        """The counts now, with the daemon's ``gauges`` (the other :class:`DaemonStats` fields)."""
        with self._lock:
            return DaemonStats(
                host=host,
                sent_bytes=dict(self._sent_bytes),
                transfers=dict(self._transfers),
                dataplane_errors=self._errors,
                resolved=dict(self._resolved),
                aggregates_sent=dict(self._aggregates_sent),
                received_bytes=dict(self._received_bytes),
                received_frames=self._frames,
                aggregate_members=self._members,
                aggregate_member_bytes=self._member_bytes,
                pushes=dict(self._pushes),
                push_bytes=dict(self._push_bytes),
                push_raw_bytes=dict(self._push_raw),
                update_bytes_received=dict(self._update_bytes),
                update_raw_bytes_received=dict(self._update_raw),
                model_bytes_served=dict(self._model_bytes),
                model_raw_bytes_served=dict(self._model_raw),
                **gauges,
            )
