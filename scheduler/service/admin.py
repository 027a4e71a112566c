"""The scheduler's admin service: cluster status and what holds each job back (``mlfabric status``).

:class:`~.observe.Activity` remembers, in the service's clock, when each worker announced an
update and how many bytes each link carried; the service state notes the pushes there and the
core the measured transfers (through the state's :class:`~.observe.Recorder`).
:func:`cluster_status` is a pure function from the state, the estimated graph and the
activity to a :class:`~mlfabric.proto.v1.admin_pb2.ClusterStatus`, including the report
users of parameter servers and all-reduce ask for: which worker and which link hold a job
back now.

- A worker is a *straggler* when its mean interval between pushes (its iteration: compute,
  get, push) is above ``STRAGGLER_FACTOR`` times the job's median over workers that pushed
  at least twice in the window, or when it did not push in the window while others did.
- A link on the path from a job's workers to its servers holds the job back when its
  utilisation (reported bytes over the window / configured rate) is at least
  ``BUSY_UTILISATION``, or when the estimated rate (residual bandwidth, paper §5) is below
  ``DEGRADED_RATIO`` of the configured one; the busiest, else the most degraded, is named.

:class:`AdminServicer` answers ``Admin.Status`` and ``Admin.Trace`` (the state's trace ring,
:mod:`.tracelog`) on the scheduler's gRPC server.
"""

from __future__ import annotations

import statistics
from itertools import pairwise
from typing import Any

import grpc
import networkx as nx

from mlfabric.proto.v1 import admin_pb2 as apb
from mlfabric.proto.v1 import admin_pb2_grpc
from mlfabric.scheduler.service.core import SchedulerCore
from mlfabric.scheduler.service.observe import Activity, per_link, per_server
from mlfabric.scheduler.service.records import Job, SchedulerError
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.scheduler.service.tracelog import MAX_REPLY
from mlfabric.wire.tls import auth_context_names

__all__ = [
    "BUSY_UTILISATION",
    "DEFAULT_WINDOW",
    "DEGRADED_RATIO",
    "STRAGGLER_FACTOR",
    "AdminServicer",
    "cluster_status",
    "refused_admin",
]

#: seconds of history behind rates when the request names none
DEFAULT_WINDOW = 30.0
#: a worker this many times slower than the job's median is a straggler
STRAGGLER_FACTOR = 1.5
#: a link this busy holds its jobs back
BUSY_UTILISATION = 0.8
#: a link estimated below this fraction of its configured rate is degraded
DEGRADED_RATIO = 0.5


def cluster_status(
    state: SchedulerState,
    estimated: nx.DiGraph,
    activity: Activity,
    now: float,
    window: float = DEFAULT_WINDOW,
    policy: str = "",
) -> apb.ClusterStatus:
    """The cluster now: daemons, jobs, links and what holds each job back.

    Parameters
    ----------
    state : SchedulerState
    estimated : networkx.DiGraph
        The graph with the estimator's capacities (residual bandwidth).
    activity : Activity
    now : float
        The service's clock (the activity's time base).
    window : float
        Seconds behind rates and utilisations; early in a run, the seconds since the first
        push or transfer (:meth:`~.observe.Activity.span`), reported as ``window_seconds``.
    policy : str
        The policy's name, reported as is.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.records import JobParams
    >>> s = SchedulerState(star(3, 8e9))
    >>> act = s.recorder.activity
    >>> for h in ("h0", "h1", "h2"):
    ...     _ = s.connect(h, "127.0.0.1:1")
    >>> _ = s.register_server("h0", "j", "ps", (), JobParams(tau_max=4), version=0)
    >>> _ = s.register_worker("h1", "j", "fast"); _ = s.register_worker("h2", "j", "slow")
    >>> for i in range(5):
    ...     _ = s.add_update("h1", f"h1/{i}", "j", "ps", "fast", 1, 1.0, 0, now=float(i))
    >>> for i in range(2):
    ...     _ = s.add_update("h2", f"h2/{i}", "j", "ps", "slow", 1, 1.0, 0, now=4.0 * i)
    >>> act.transfer(("h1", "sw", "h0"), 9 * 10**9, now=4.0)
    >>> st = cluster_status(s, s.graph, act, now=4.0, window=10.0)
    >>> [(b.kind, b.name) for b in st.holding_back]
    [('worker', 'slow'), ('link', 'sw->h0')]
    """
    window = activity.span(now, window)  # early in a run: the seconds there were
    st = apb.ClusterStatus(
        policy=policy, window_seconds=window, pending=len(state.pending), in_flight=len(state.in_flight)
    )
    for d in sorted(state.daemons.values(), key=lambda d: d.host):
        st.daemons.add(host=d.host, data_address=d.data_address, version=d.version)
    pending, in_flight = per_server(state.pending.values()), per_server(state.in_flight.values())
    per_worker: dict[tuple[str, str], int] = {}
    for u in state.pending.values():
        per_worker[(u.job, u.worker)] = per_worker.get((u.job, u.worker), 0) + 1
    crossing = per_link(state.in_flight.values())

    links: dict[tuple[str, str], apb.LinkStatus] = {}
    for u, v, data in state.graph.edges(data=True):
        configured = float(data["capacity"])
        est = float(estimated[u][v]["capacity"]) if estimated.has_edge(u, v) else configured
        measured = activity.link_bytes((u, v), now, window) / window
        links[(u, v)] = st.links.add(
            src=u,
            dst=v,
            configured_bytes_per_second=configured,
            estimated_bytes_per_second=est,
            measured_bytes_per_second=measured,
            utilisation=measured / configured if configured > 0 else 0.0,
            in_flight=crossing.get((u, v), 0),
        )

    for job in sorted(state.jobs.values(), key=lambda j: j.name):
        js = st.jobs.add(name=job.name, tau_max=job.params.tau_max)
        for s in sorted(job.servers.values(), key=lambda s: s.name):
            key = (job.name, s.name)
            js.servers.add(
                name=s.name,
                host=s.host,
                version=s.version,
                pending=pending.get(key, 0),
                in_flight=in_flight.get(key, 0),
            )
        for name, host in sorted(job.workers.items()):
            rate, interval, _ = activity.worker_rate(job.name, name, now, window)
            js.workers.add(
                name=name,
                host=host,
                pushes_per_second=rate,
                mean_interval_seconds=interval,
                pending=per_worker.get((job.name, name), 0),
            )
        worker = _straggler(js, window)
        if worker is not None:
            st.holding_back.append(worker)
        held = _held_by_link(state, job, links)
        if held is not None:
            st.holding_back.append(held)
    return st


def _straggler(js: apb.JobStatus, window: float) -> apb.Bottleneck | None:
    timed = [w for w in js.workers if w.mean_interval_seconds > 0]
    silent = [w for w in js.workers if w.pushes_per_second == 0]
    if silent and timed:
        w = silent[0]
        return apb.Bottleneck(
            job=js.name,
            kind="worker",
            name=w.name,
            reason=f"no push in the last {window:g} s while others push",
        )
    if len(timed) < 2:
        return None
    median = statistics.median(w.mean_interval_seconds for w in timed)
    slowest = max(timed, key=lambda w: w.mean_interval_seconds)
    if median <= 0 or slowest.mean_interval_seconds < STRAGGLER_FACTOR * median:
        return None
    x = slowest.mean_interval_seconds
    return apb.Bottleneck(
        job=js.name,
        kind="worker",
        name=slowest.name,
        reason=f"mean push interval {x:.3g} s, {x / median:.1f}x the job's median {median:.3g} s",
    )


def _held_by_link(
    state: SchedulerState, job: Job, links: dict[tuple[str, str], apb.LinkStatus]
) -> apb.Bottleneck | None:
    users: dict[tuple[str, str], int] = {}  # worker-to-server paths crossing each link
    for whost in set(job.workers.values()):
        for s in job.servers.values():
            if whost == s.host:
                continue
            try:
                for link in pairwise(state.path(whost, s.host)):
                    users[link] = users.get(link, 0) + 1
            except SchedulerError:
                continue
    candidates = [links[link] for link in sorted(users) if link in links]
    busy = [ls for ls in candidates if ls.utilisation >= BUSY_UTILISATION]
    if busy:  # the busiest; of equally busy ones, the one most paths share
        ls = max(busy, key=lambda ls: (ls.utilisation, users[(ls.src, ls.dst)]))
        gbps = ls.configured_bytes_per_second * 8 / 1e9
        reason = f"busy: {ls.utilisation:.0%} of its configured {gbps:.3g} Gbit/s"
        return apb.Bottleneck(job=job.name, kind="link", name=f"{ls.src}->{ls.dst}", reason=reason)
    degraded = [
        ls
        for ls in candidates
        if ls.configured_bytes_per_second > 0
        and ls.estimated_bytes_per_second < DEGRADED_RATIO * ls.configured_bytes_per_second
    ]
    if degraded:
        ls = min(degraded, key=lambda ls: ls.estimated_bytes_per_second / ls.configured_bytes_per_second)
        reason = (
            f"degraded: estimated {ls.estimated_bytes_per_second * 8 / 1e9:.3g} Gbit/s of a configured "
            f"{ls.configured_bytes_per_second * 8 / 1e9:.3g}"
        )
        return apb.Bottleneck(job=job.name, kind="link", name=f"{ls.src}->{ls.dst}", reason=reason)
    return None


def refused_admin(names: frozenset[str], admins: frozenset[str] | None) -> str | None:
    """Why a client whose certificate carries ``names`` may not use the admin service; None if it may.

    ``admins`` are the certificate names allowed (the scheduler's ``tls_admin``, by default
    ``admin``: the ``admin.pem`` of ``mlfabric certs``); None when the scheduler serves no
    mTLS, and then every client may. A host's certificate is not an admin certificate: a
    daemon (or whoever holds a host's key) may not read the cluster's status or trace.

    Examples
    --------
    >>> refused_admin(frozenset({"admin"}), frozenset({"admin"})) is None
    True
    >>> refused_admin(frozenset({"h0"}), frozenset({"admin"}))
    "the admin service needs an admin certificate (names: admin); this client's certificate names h0"
    >>> refused_admin(frozenset(), None) is None
    True
    """
    if admins is None or names & admins:
        return None
    return (
        f"the admin service needs an admin certificate (names: {', '.join(sorted(admins))}); "
        f"this client's certificate names {', '.join(sorted(names)) or 'nothing'}"
    )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """``Admin.Status`` and ``Admin.Trace`` of a running :class:`~.core.SchedulerCore` (runs on its loop).

    Both read what the core's state recorded (its :class:`~.observe.Recorder`): the activity
    behind the status, the trace ring if it has one. Under mTLS both answer only a client whose
    certificate carries one of ``admins`` (:func:`refused_admin`; else ``PERMISSION_DENIED``).

    Parameters
    ----------
    core : SchedulerCore
    admins : frozenset of str, optional
        Certificate names allowed (None: no mTLS, every client).
    """

    def __init__(self, core: SchedulerCore, admins: frozenset[str] | None = None) -> None:
        self._core = core
        self._admins = admins

    async def _check(self, context: Any) -> None:
        if self._admins is None:
            return
        why = refused_admin(auth_context_names(context.auth_context()), self._admins)
        if why is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    async def Trace(self, request: apb.TraceRequest, context: Any) -> apb.TraceReply:
        """The trace events from ``request.cursor`` on (see :mod:`.tracelog`)."""
        await self._check(context)
        trace = self._core.recorder.trace
        if trace is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler records no trace")
        assert trace is not None
        return trace.reply(request.cursor, min(request.max_events or MAX_REPLY, MAX_REPLY))

    async def Status(self, request: apb.StatusRequest, context: Any) -> apb.ClusterStatus:
        """The cluster now (see :func:`cluster_status`)."""
        await self._check(context)
        window = request.window_seconds or DEFAULT_WINDOW
        if window < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"window_seconds must be > 0, got {window}")
        core = self._core
        return cluster_status(
            core.state,
            core.estimator.estimated_graph(),
            core.recorder.activity,
            core.clock(),
            window,
            core.policy.name,
        )
