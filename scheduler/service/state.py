"""The scheduler service's state as plain data with pure methods (DESIGN §3, paper §4).

:class:`SchedulerState` holds what the central scheduler knows: the bandwidth graph, the
registered daemons (host -> data-plane address), the roles of every job (servers with
their model spec, job params and model version; workers), the updates that are ready and
not yet released (:class:`~mlfabric.scheduler.policies.base.PendingUpdate`), the transfers in
flight (:class:`~mlfabric.scheduler.policies.base.InFlight`) and the outcome of each update.

The state notes each of its own changes (an update ready, a transfer released or reported, an
aggregate leaving its aggregator, every outcome) in the
:class:`~mlfabric.scheduler.service.observe.Recorder` it was given: the activity behind
``mlfabric status``, the trace ring, the outcome counters of ``/metrics``.

Nothing here does I/O or reads a clock: times are passed in. Every domain problem is an
exception subclassing :class:`~mlfabric.scheduler.service.records.SchedulerError` whose
message names the host, job, server, worker or update at fault; the service turns them into
replies. The records it holds and the errors are :mod:`mlfabric.scheduler.service.records`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import networkx as nx

from mlfabric.scheduler.core.graph import TopologyError, hosts, shortest_path
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate, RoundSpec, Snapshot
from mlfabric.scheduler.service.observe import Recorder
from mlfabric.scheduler.service.records import (
    Cleanup,
    DaemonInfo,
    DuplicateServer,
    DuplicateUpdate,
    DuplicateWorker,
    HostAlreadyConnected,
    Job,
    JobParams,
    NoPath,
    OutcomeKind,
    OutcomeLog,
    ParamsMismatch,
    SchedulerError,
    ServerRole,
    TensorSpec,
    TransferResult,
    UnknownDaemon,
    UnknownHost,
    UnknownJob,
    UnknownServer,
    UnknownUpdate,
    UnknownWorker,
    UpdateOutcome,
    address_problem,
    model_bytes,
)

__all__ = ["MAX_OUTCOMES", "STALL_FACTOR", "STALL_SLACK", "SchedulerState", "stalled_after"]

#: outcomes kept for inspection (oldest forgotten first; :class:`~.records.OutcomeLog`): a few
#: minutes' worth at 100 updates a second (100,000 before issue 24: ~17 minutes of them, the
#: bulk of the RSS a 10-minute run gained)
MAX_OUTCOMES = 10_000


#: A transfer in flight without a report is stalled after STALL_FACTOR x its expected
#: duration + STALL_SLACK seconds (:meth:`SchedulerState.expire_stalled`).
STALL_FACTOR = 4.0
STALL_SLACK = 30.0


def stalled_after(f: InFlight) -> float:
    """When the transfer ``f``, in flight without a report, counts as stalled (its deadline).

    Examples
    --------
    >>> stalled_after(InFlight("h1/1", "j", "ps", ("h1", "sw", "h0"), 8, 10.0, 12.0))
    48.0
    """
    return f.started_at + STALL_FACTOR * max(0.0, f.expected_end - f.started_at) + STALL_SLACK


class SchedulerState:
    """Everything the scheduler knows, mutated only through methods that check their input.

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph (see :mod:`mlfabric.scheduler.core.graph`); daemons may only say
        hello for its hosts.
    recorder : Recorder, optional
        Where the state notes its changes (a fresh one, without a trace, by default).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> s = SchedulerState(star(2, 8e9))
    >>> _ = s.connect("h0", "127.0.0.1:9000"); _ = s.connect("h1", "127.0.0.1:9001")
    >>> _ = s.register_server("h0", "j", "ps", (), JobParams(tau_max=4), version=0)
    >>> _ = s.register_worker("h1", "j", "w0")
    >>> s.add_update("h1", "h1/1", "j", "ps", "w0", 1024, 1.0, 0, now=0.0).dst_host
    'h0'
    """

    def __init__(self, graph: nx.DiGraph, recorder: Recorder | None = None) -> None:
        self.graph = graph
        self.recorder = Recorder() if recorder is None else recorder
        self._graph_hosts = frozenset(hosts(graph))
        self.daemons: dict[str, DaemonInfo] = {}
        self.jobs: dict[str, Job] = {}
        self.pending: dict[str, PendingUpdate] = {}
        self.in_flight: dict[str, InFlight] = {}
        self.outcomes = OutcomeLog(MAX_OUTCOMES)
        self._paths: dict[tuple[str, str], tuple[str, ...]] = {}

    def replace_graph(self, graph: nx.DiGraph) -> None:
        """Make ``graph`` the bandwidth graph (a reload), keeping daemons, roles and updates.

        The host set and the path cache follow the graph; paths already held by pending or
        in-flight updates are theirs and stay.

        Raises
        ------
        ValueError
            A connected daemon's host is not a host of ``graph`` (nothing is changed).

        Examples
        --------
        >>> from mlfabric.scheduler.core.graph import star
        >>> s = SchedulerState(star(2, 8e9))
        >>> _ = s.connect("h0", "127.0.0.1:9000")
        >>> s.path("h0", "h1")
        ('h0', 'sw', 'h1')
        >>> s.replace_graph(star(3, 8e9))
        >>> s.path("h0", "h2")
        ('h0', 'sw', 'h2')
        >>> s.replace_graph(star(["x"], 8e9))
        Traceback (most recent call last):
        ...
        ValueError: the new topology lacks the hosts of connected daemons: h0 (kept the old one)
        """
        new_hosts = frozenset(hosts(graph))
        missing = sorted(h for h in self.daemons if h not in new_hosts)
        if missing:
            raise ValueError(
                "the new topology lacks the hosts of connected daemons: "
                f"{', '.join(missing)} (kept the old one)"
            )
        self.graph = graph
        self._graph_hosts = new_hosts
        self._paths.clear()

    # ------------------------------------------------------------------ daemons

    def connect(self, host: str, data_address: str, version: str = "") -> DaemonInfo:
        """Register the daemon of ``host`` (a ``Hello``).

        Raises
        ------
        UnknownHost
            ``host`` is not a host of the bandwidth graph.
        HostAlreadyConnected
            ``host`` already has a connected daemon.
        SchedulerError
            ``data_address`` is not ``"ip:port"`` with a port 1-65535 (the message names it).
        """
        if host not in self._graph_hosts:
            known = ", ".join(sorted(self._graph_hosts))
            raise UnknownHost(f"host '{host}' is not a host of the bandwidth graph (hosts: {known})")
        if host in self.daemons:
            raise HostAlreadyConnected(f"host '{host}' already has a connected daemon")
        if not data_address:
            raise SchedulerError(f"host '{host}': hello without a data-plane address")
        problem = address_problem(data_address)
        if problem is not None:
            raise SchedulerError(f"host '{host}': data-plane address {data_address!r} {problem}")
        info = DaemonInfo(host, data_address, version)
        self.daemons[host] = info
        return info

    def disconnect(self, host: str) -> Cleanup:
        """Forget the daemon of ``host``: its roles, its pending updates and its transfers.

        Pending updates of other hosts bound for a server on ``host`` are dropped too.
        """
        if host not in self.daemons:
            raise UnknownDaemon(f"host '{host}' has no connected daemon")
        del self.daemons[host]
        dropped: list[tuple[PendingUpdate, str]] = []
        changed: list[str] = []
        for job in self.jobs.values():
            gone = [s for s in job.servers.values() if s.host == host]
            for server in gone:
                dropped += self._drop_for_server(job.name, server.name, f"server '{server.name}' left")
                del job.servers[server.name]
            job.workers = {w: h for w, h in job.workers.items() if h != host}
            if gone:
                changed.append(job.name)
        reason = f"the daemon of host '{host}' disconnected"
        for u in [u for u in self.pending.values() if u.src_host == host]:
            dropped.append((u, reason))
            self._resolve(u.update_id, OutcomeKind.DROPPED, reason)
            del self.pending[u.update_id]
        lost = [f for f in self.in_flight.values() if host in (f.path[0], f.path[-1])]
        for f in lost:
            del self.in_flight[f.update_id]
        self._forget_empty_jobs()
        return Cleanup(tuple(dropped), tuple(lost), tuple(changed))

    def address(self, host: str) -> str:
        """The data-plane address of ``host``'s daemon."""
        try:
            return self.daemons[host].data_address
        except KeyError:
            raise UnknownDaemon(f"host '{host}' has no connected daemon") from None

    # -------------------------------------------------------------------- roles

    def register_server(
        self,
        host: str,
        job: str,
        name: str,
        model: Iterable[TensorSpec],
        params: JobParams,
        version: int,
    ) -> Job:
        """Register server ``name`` of ``job`` on ``host``; the first server creates the job.

        Raises
        ------
        DuplicateServer
            The job already has a server called ``name``.
        ParamsMismatch
            ``params`` differ from the params the job's first server gave.
        """
        self._require_daemon(host)
        if not name:
            raise SchedulerError(f"job '{job}': a server needs a name")
        record = self.jobs.get(job)
        if record is None:
            record = self.jobs[job] = Job(job, params)
        elif not record.servers:
            record.params = params  # the job's servers had all left: a fresh start
        elif name in record.servers:
            other = record.servers[name].host
            raise DuplicateServer(f"job '{job}' already has a server '{name}' (on host '{other}')")
        elif record.params != params:
            raise ParamsMismatch(
                f"job '{job}': server '{name}' gives {params}, but the job has {record.params}"
            )
        record.servers[name] = ServerRole(job, name, host, tuple(model), version)
        return record

    def register_worker(self, host: str, job: str, name: str) -> Job:
        """Register worker ``name`` of ``job`` on ``host``; the job must have a server.

        Raises
        ------
        UnknownJob
            No server of ``job`` has registered.
        DuplicateWorker
            ``job`` has a worker ``name`` on another host whose daemon is connected (on the same
            host the daemon tells its processes apart; a host whose daemon left has no workers).
        """
        self._require_daemon(host)
        record = self._job(job)
        other = record.workers.get(name)
        if other is not None and other != host and other in self.daemons:
            raise DuplicateWorker(
                f"job '{job}' already has a worker '{name}' on host '{other}'; "
                "worker names are unique within a job"
            )
        record.workers[name] = host
        return record

    def unregister_server(self, host: str, job: str, name: str) -> Cleanup:
        """Remove server ``name``; its pending updates are dropped with a reason."""
        server = self._server(job, name)
        if server.host != host:
            raise UnknownServer(f"server '{name}' of job '{job}' is on host '{server.host}', not '{host}'")
        dropped = self._drop_for_server(job, name, f"server '{name}' of job '{job}' unregistered")
        del self.jobs[job].servers[name]
        self._forget_empty_jobs()
        return Cleanup(dropped=tuple(dropped), jobs_changed=(job,))

    def unregister_worker(self, host: str, job: str, name: str) -> None:
        """Remove worker ``name``; its updates already announced still go."""
        record = self.jobs.get(job)
        if record is None or record.workers.get(name) != host:
            raise UnknownWorker(f"job '{job}' has no worker '{name}' on host '{host}'")
        del record.workers[name]

    def server_role(self, job: str, name: str) -> ServerRole:
        """Server ``name`` of ``job`` (``UnknownJob`` / ``UnknownServer`` naming them)."""
        return self._server(job, name)

    def promote(self, job: str, name: str, host: str, version: int) -> list[str]:
        """Server ``name`` now lives on ``host`` (its replica took over, docs/replication.md).

        The pending updates bound for it are re-routed there; returns their ids (to be planned
        again). Raises ``UnknownDaemon``, ``UnknownJob``, ``UnknownServer``.
        """
        self._require_daemon(host)
        server = self._server(job, name)
        self.jobs[job].servers[name] = replace(server, host=host, version=version)
        moved = []
        for u in [u for u in self.pending.values() if (u.job, u.server) == (job, name)]:
            self.pending[u.update_id] = replace(u, dst_host=host)
            moved.append(u.update_id)
        return moved

    def servers(self, job: str) -> tuple[ServerRole, ...]:
        """The servers of ``job`` with their current versions, by name (none for an unknown job)."""
        record = self.jobs.get(job)
        if record is None:
            return ()
        return tuple(s for _, s in sorted(record.servers.items()))

    def worker_hosts(self, job: str) -> frozenset[str]:
        """Hosts with at least one worker of ``job`` (empty for an unknown job)."""
        record = self.jobs.get(job)
        return frozenset(record.workers.values()) if record else frozenset()

    # ------------------------------------------------------------------ updates

    def add_update(
        self,
        host: str,
        update_id: str,
        job: str,
        server: str,
        worker: str,
        nbytes: int,
        norm: float,
        base_version: int,
        now: float,
        resent: bool = False,
        codec: str = "",
    ) -> PendingUpdate:
        """Record that ``update_id`` is ready at ``host`` (an ``UpdateReady``).

        ``now`` is the scheduler's clock: daemon clocks are not comparable across hosts.
        ``resent``: announced again after its server failed over (``PendingUpdate.resent``).
        ``codec``: the codec its payload travels with (``UpdateReady.codec``), for the trace.

        Raises
        ------
        UnknownJob, UnknownServer, UnknownWorker
            The job, the server (of that job) or the worker (on that host) is unknown.
        DuplicateUpdate
            ``update_id`` is still pending or in flight.
        NoPath
            The graph has no path from ``host`` to the server's host.
        """
        self._require_daemon(host)
        if update_id in self.pending or update_id in self.in_flight:
            raise DuplicateUpdate(f"update '{update_id}' is already pending or in flight")
        target = self._server(job, server)
        if self.jobs[job].workers.get(worker) != host:
            raise UnknownWorker(f"job '{job}' has no worker '{worker}' on host '{host}'")
        limit = model_bytes(target.model)
        if target.model and not 0 <= nbytes <= limit:
            raise SchedulerError(
                f"update '{update_id}' announces {nbytes} bytes, more than the {limit}-byte model "
                f"of server '{server}' of job '{job}' (an update is at most the model's size)"
            )
        self.path(host, target.host)
        u = PendingUpdate(
            update_id=update_id,
            job=job,
            server=server,
            worker=worker,
            src_host=host,
            dst_host=target.host,
            bytes=int(nbytes),
            norm=float(norm),
            base_version=int(base_version),
            ready_at=now,
            resent=bool(resent),
            codec=codec,
        )
        self.pending[update_id] = u
        self.recorder.update_ready(u)
        return u

    def release(
        self, update_id: str, path: tuple[str, ...], started_at: float, expected_end: float
    ) -> InFlight:
        """Move a pending update in flight along ``path`` (its transfer was released)."""
        u = self.pending.pop(update_id, None)
        if u is None:
            raise UnknownUpdate(f"update '{update_id}' is not pending")
        f = InFlight(u.update_id, u.job, u.server, tuple(path), u.bytes, started_at, expected_end)
        self.in_flight[update_id] = f
        self.recorder.released(f)
        return f

    def drop(self, update_id: str, reason: str) -> PendingUpdate:
        """Drop a pending update with ``reason`` (a policy's ``Drop``)."""
        u = self.pending.pop(update_id, None)
        if u is None:
            raise UnknownUpdate(f"update '{update_id}' is not pending")
        self._resolve(update_id, OutcomeKind.DROPPED, reason)
        return u

    def report(self, result: TransferResult) -> InFlight:
        """Account for a finished (or failed) transfer and track the server's version.

        Returns the in-flight entry the report closes. A failed transfer (``ok`` false)
        is forgotten: its sender resolves the push (``outcome``, if set, says how) or
        re-announces the update.

        Raises
        ------
        UnknownUpdate
            The update is not in flight (e.g. its entry was cleaned up).
        """
        f = self.in_flight.pop(result.update_id, None)
        if f is None:
            raise UnknownUpdate(f"update '{result.update_id}' is not in flight")
        if result.outcome is not None:
            reason = (result.reason or result.error) if result.outcome is not OutcomeKind.APPLIED else ""
            self._resolve(f.update_id, result.outcome, reason, result.delay, result.server_version)
        if result.ok and result.outcome is not None:
            server = self.jobs.get(f.job, Job(f.job, JobParams())).servers.get(f.server)
            if server is not None and result.server_version > server.version:
                self.jobs[f.job].servers[f.server] = replace(server, version=result.server_version)
        self.recorder.reported(f, result)
        return f

    def resolve(self, host: str, update_id: str, kind: OutcomeKind, reason: str) -> PendingUpdate | None:
        """A daemon resolved a push itself (``UpdateResolved``); forget the update if pending."""
        u = self.pending.get(update_id)
        if u is not None and u.src_host != host:
            raise UnknownUpdate(f"update '{update_id}' was announced by host '{u.src_host}', not '{host}'")
        self.pending.pop(update_id, None)
        self._resolve(update_id, kind, reason)
        return u

    def requeue(self, u: PendingUpdate) -> PendingUpdate:
        """Make ``u`` pending again (its aggregate failed; its source still holds the payload).

        Bound for its server's host now: where the server moved if its replica was promoted
        meanwhile (an aggregate bound for the failed server failed with it).

        Raises ``UnknownDaemon``/``UnknownJob``/``UnknownServer`` if its source, job or server
        is gone, ``DuplicateUpdate`` if it is pending or in flight already.
        """
        self._require_daemon(u.src_host)
        server = self._server(u.job, u.server)
        if u.update_id in self.pending or u.update_id in self.in_flight:
            raise DuplicateUpdate(f"update '{u.update_id}' is already pending or in flight")
        u = replace(u, dst_host=server.host)
        self.pending[u.update_id] = u
        return u

    def track(self, f: InFlight | None, untrack: str = "") -> InFlight | None:
        """Count ``f`` (an aggregate leaving its aggregator) in flight; forget ``untrack``'s entry."""
        if f is not None:
            self.recorder.forwarded(f)
            self.in_flight[f.update_id] = f
        return self.in_flight.pop(untrack, None) if untrack else f

    def record(self, update_id: str, kind: OutcomeKind, reason: str, delay: int, version: int) -> None:
        """Record how the push of ``update_id`` (a member of an aggregate) resolved."""
        self._resolve(update_id, kind, reason, delay, version)

    # ----------------------------------------------------------------- queries

    def path(self, src: str, dst: str) -> tuple[str, ...]:
        """Hop-count shortest path from ``src`` to ``dst`` (cached; ``NoPath`` if none)."""
        key = (src, dst)
        cached = self._paths.get(key)
        if cached is None:
            try:
                cached = tuple(shortest_path(self.graph, src, dst))
            except TopologyError as exc:
                raise NoPath(str(exc)) from None
            self._paths[key] = cached
        return cached

    def sharing(self, update_id: str, now: float) -> int:
        """How many transfers, on average, shared the busiest link of ``update_id``'s path.

        Each other in-flight transfer on a link counts with the fraction of this transfer's
        time in flight (``started_at`` to ``now``) that it overlapped; the result is rounded
        and at least 1. Under network time-sharing this is 1; under ``fair`` it is the
        number of concurrent transfers on the bottleneck (the bandwidth estimator scales
        the measured rate by it).

        Examples
        --------
        >>> from mlfabric.scheduler.core.graph import star
        >>> s = SchedulerState(star(3, 8e9))
        >>> s.in_flight = {u: InFlight(u, "j", "ps", (h, "sw", "h0"), 10, 0.0, 1.0)
        ...                for u, h in (("a", "h1"), ("b", "h2"))}
        >>> s.sharing("a", now=1.0)
        2
        """
        this = self.in_flight.get(update_id)
        if this is None:
            return 1
        span = now - this.started_at
        links = set(zip(this.path, this.path[1:], strict=False))
        load: dict[tuple[str, str], float] = dict.fromkeys(links, 1.0)
        for other in self.in_flight.values():
            if other is this or span <= 0:
                continue
            overlap = (now - max(other.started_at, this.started_at)) / span
            for link in links.intersection(zip(other.path, other.path[1:], strict=False)):
                load[link] += min(1.0, max(0.0, overlap))
        return max(1, round(max(load.values(), default=1.0)))

    def server_versions(self) -> dict[tuple[str, str], int]:
        """(job, server) -> the server's model version as last reported."""
        return {(j.name, s.name): s.version for j in self.jobs.values() for s in j.servers.values()}

    def snapshot(self, now: float, graph: nx.DiGraph | None = None) -> Snapshot:
        """What a policy sees at ``now``; ``graph`` (estimated capacities) defaults to the static one."""
        return Snapshot(
            now=now,
            graph=self.graph if graph is None else graph,
            in_flight=tuple(self.in_flight.values()),
            server_versions=self.server_versions(),
            tau_max={j.name: j.params.tau_max for j in self.jobs.values()},
            rounds=self.rounds(),
        )

    def rounds(self) -> dict[tuple[str, str], RoundSpec]:
        """(job, server) -> its round membership, for synchronous jobs whose workers are all known.

        A job whose ``sync_workers`` differs from the number of its registered workers (some
        not registered yet, or rounds of a subset) has no membership: its rounds are planned
        as their updates come.
        """
        out = {}
        for j in self.jobs.values():
            n = j.params.sync_workers
            if n > 0 and len(j.workers) == n:
                spec = RoundSpec(dict(j.workers))
                out.update({(j.name, s): spec for s in j.servers})
        return out

    def source_host(self, update_id: str) -> str:
        """The host where a pending or in-flight update is (where directives about it go)."""
        u = self.pending.get(update_id)
        if u is not None:
            return u.src_host
        f = self.in_flight.get(update_id)
        if f is not None:
            return f.path[0]
        raise UnknownUpdate(f"update '{update_id}' is neither pending nor in flight")

    # ---------------------------------------------------------------- helpers

    def _require_daemon(self, host: str) -> None:
        if host not in self.daemons:
            raise UnknownDaemon(f"host '{host}' has no connected daemon")

    def _job(self, job: str) -> Job:
        record = self.jobs.get(job)
        if record is None or not record.servers:
            known = ", ".join(sorted(j.name for j in self.jobs.values() if j.servers)) or "none"
            raise UnknownJob(f"unknown job '{job}': no server registered for it (jobs: {known})")
        return record

    def _server(self, job: str, name: str) -> ServerRole:
        record = self._job(job)
        server = record.servers.get(name)
        if server is None:
            others = [j.name for j in self.jobs.values() if name in j.servers]
            hint = f" (it is a server of job '{others[0]}')" if others else ""
            raise UnknownServer(f"job '{job}' has no server '{name}'{hint}")
        return server

    def _drop_for_server(self, job: str, server: str, reason: str) -> list[tuple[PendingUpdate, str]]:
        dropped = [u for u in self.pending.values() if u.job == job and u.server == server]
        for u in dropped:
            del self.pending[u.update_id]
            self._resolve(u.update_id, OutcomeKind.DROPPED, reason)
        return [(u, reason) for u in dropped]

    def _forget_empty_jobs(self) -> None:
        for name in [n for n, j in self.jobs.items() if not j.servers and not j.workers]:
            del self.jobs[name]

    def stall_deadline(self) -> float | None:
        """When the first transfer in flight without a report counts as stalled (None: none in flight)."""
        return min((stalled_after(f) for f in self.in_flight.values()), default=None)

    def expire_stalled(self, now: float) -> list[InFlight]:
        """Forget the transfers in flight with no report past their deadline; return them.

        A transfer's deadline is :data:`STALL_FACTOR` times its expected duration plus
        :data:`STALL_SLACK` seconds after its start. A peer that announced an update and never
        reports would otherwise hold its bottleneck for ever (every transfer planned behind it
        waits). The update's outcome is DROPPED naming the deadline; the daemon holding the
        update resolves its push itself (its own transfer and push deadlines), and a late
        report finds nothing in flight.
        """
        stalled = [f for f in self.in_flight.values() if now > stalled_after(f)]
        for f in stalled:
            del self.in_flight[f.update_id]
            self._resolve(
                f.update_id,
                OutcomeKind.DROPPED,
                f"no report on the transfer of '{f.update_id}' by its deadline {stalled_after(f):g} s "
                f"(expected {f.expected_end - f.started_at:g} s from {f.started_at:g} s): forgotten",
            )
        return stalled

    def _resolve(
        self,
        update_id: str,
        kind: OutcomeKind,
        reason: str,
        delay: int | None = None,
        version: int | None = None,
    ) -> None:
        outcome = UpdateOutcome(update_id, kind, reason, delay, version)
        self.outcomes.record(outcome)
        self.recorder.resolved(outcome)
