"""The scheduler's replicas: registration, the servers' logs, replica sends, promotion.

:class:`ReplicaBook` is the books (pure: no I/O; directives are returned): which server has
which replica (one each, on another host), the entries each server applied that its replica
has not acknowledged (``ServerApplied``, with the norm), how far the replica is and how far
forwarding was ordered (``ReplicaStatus``), and whether the server waits for it. It gives the
policies their replica views and turns the replica sends of the
:class:`~mlfabric.scheduler.policies.replication.ReplicationPolicy` into ``ReplicateDirective``
messages to the server's daemon.

:class:`Replication` is what the service core does with it, pure too (each call returns
:class:`~mlfabric.scheduler.service.effects.Effects` the core executes): a replica's
``RegisterRole``, the two daemon messages, the replica sends of each decision, the servers as
``RoleAck``/``JobUpdate`` list them, and **promotion** — when a
server's process unregisters or its daemon's session ends, its replica becomes the server
(the server role moves to the replica's host, the pending updates bound for it are re-routed
there and planned again, the replica's daemon gets a ``PromoteDirective`` and every daemon
with a worker of the job a ``JobUpdate``). docs/replication.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.base import PendingUpdate, ReplicaSend, ReplicaView, Snapshot
from mlfabric.scheduler.policies.replication import ReplicationPolicy
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service import wire
from mlfabric.scheduler.service.effects import Effects
from mlfabric.scheduler.service.records import (
    DuplicateReplica,
    FailedOver,
    ModelMismatch,
    SchedulerError,
)
from mlfabric.scheduler.service.state import SchedulerState

__all__ = ["REREGISTER_GRACE", "ReplicaBook", "ReplicaRecord", "Replication"]

log = logging.getLogger(__name__)

#: seconds a replica whose daemon lost its session stays attached, waiting for it to register
#: again (its server's daemon keeps the replication log and the bound meanwhile); the default
#: of :class:`ReplicaBook`'s ``grace`` (``mlfabric scheduler --replica-grace``)
REREGISTER_GRACE = 10.0

Directives = list[tuple[str, pb.Directive]]


@dataclass
class ReplicaRecord:
    """One server's replica and what it lacks."""

    job: str
    server: str
    name: str
    host: str
    div_max: float
    version: int = 0
    directed: int = 0
    #: version -> (update_id, norm) of entries applied at the server, not acknowledged
    log: dict[int, tuple[str, float]] = field(default_factory=dict)
    blocked: bool = False
    blocked_count: int = 0
    error: str = ""
    #: the server's daemon runs a replication log for it (its first ``ReplicaStatus``): only
    #: then may it be promoted (a replica detached meanwhile has no log and may be stale)
    confirmed: bool = False
    #: when the replica's daemon lost its session (None: connected); detached if it does not
    #: register again within the book's grace (:data:`REREGISTER_GRACE`)
    lost_at: float | None = None
    #: registered again after it was detached (or after a scheduler restart): its server's
    #: daemon sends it the model again and starts a new log; until that log's first
    #: ``ReplicaStatus`` it is not confirmed (not promotable) and the server does not wait on it
    resyncing: bool = False

    def divergence(self) -> float:
        """Sum of the norms of the entries the replica lacks."""
        return sum(norm for v, (_, norm) in self.log.items() if v > self.version)


class ReplicaBook:
    """Replicas of the servers of every job (pure).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.records import JobParams
    >>> s = SchedulerState(star(["h0", "h1"], 8e9))
    >>> _ = s.connect("h0", "127.0.0.1:9000"); _ = s.connect("h1", "127.0.0.1:9001")
    >>> _ = s.register_server("h0", "j", "ps", (), JobParams(div_max=2.0), version=0)
    >>> book = ReplicaBook(s)
    >>> [(h, d.replicate.replica_address) for h, d in book.register("h1", "j", "ps", "r", ())]
    [('h0', '127.0.0.1:9001')]
    >>> try:
    ...     book.register("h1", "j", "ps", "r2", ())
    ... except DuplicateReplica as exc:
    ...     print(exc)
    server 'ps' of job 'j' already has replica 'r' (on host 'h1')
    """

    def __init__(self, state: SchedulerState, grace: float = REREGISTER_GRACE) -> None:
        self.state = state
        #: seconds a replica whose daemon lost its session stays attached (:meth:`lost`)
        self.grace = grace
        self.records: dict[tuple[str, str], ReplicaRecord] = {}

    def register(
        self,
        host: str,
        job: str,
        server: str,
        name: str,
        model: Sequence[pb.TensorSpec],
        *,
        rejoin: bool = False,
    ) -> Directives:
        """A replica ``name`` of ``server`` registers on ``host``; the attach directive to the server.

        Raises
        ------
        UnknownJob, UnknownServer
            No such job or server.
        DuplicateReplica
            The server has a replica already.
        ModelMismatch
            ``model`` (``TensorSpec`` messages; empty: not checked) differs from the server's.
        SchedulerError
            ``host`` is the server's own host, or has no connected daemon.

        A replica whose daemon lost its session (:meth:`lost`) and registers again from the
        same host under the same name is attached again as it was: its server's daemon kept
        its replication log (the directive only gives the log the replica's address again).
        One registered again by its daemon (``rejoin``) that this book does not hold — it was
        detached after the grace, or the scheduler restarted — is **re-synced**: the directive
        has ``resync``, so the server's daemon starts a new log at its current model and sends
        that model to the replica; the record stays unconfirmed (``resyncing``) until the new
        log reports.
        """
        target = self.state.server_role(job, server)  # UnknownJob, UnknownServer
        address = self.state.address(host)
        if target.host == host:
            raise SchedulerError(
                f"replica '{name}' of server '{server}' of job '{job}' is on the server's own host "
                f"'{host}': a replica must survive its server's host"
            )
        out: Directives = []
        old = self.records.get((job, server))
        if old is not None and old.lost_at is not None and (old.host, old.name) == (host, name):
            old.lost_at = None  # (one whose re-sync never completed is re-synced again)
            d = pb.ReplicateDirective(
                job=job, server=server, replica=name, replica_host=host, replica_address=address,
                div_max=old.div_max, up_to_version=old.directed, resync=old.resyncing,
            )  # fmt: skip
            return [(target.host, pb.Directive(replicate=d))]
        if old is not None and old.lost_at is not None:  # another replica replaces the lost one
            out = self.remove(job, server)
        elif old is not None:
            raise DuplicateReplica(
                f"server '{server}' of job '{job}' already has replica '{old.name}' (on host '{old.host}')"
            )
        if model:
            mine = {t.name: (t.dtype, tuple(t.shape)) for t in model}
            theirs = {t.name: (t.dtype, tuple(t.shape)) for t in target.model}
            if mine != theirs:
                bad = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))[0]
                raise ModelMismatch(
                    f"replica '{name}': tensor '{bad}' is {mine.get(bad, 'missing')} but server '{server}' "
                    f"of job '{job}' has {theirs.get(bad, 'no such tensor')}"
                )
        div_max = self.state.jobs[job].params.div_max
        self.records[(job, server)] = ReplicaRecord(
            job, server, name, host, div_max, version=target.version, resyncing=rejoin
        )
        d = pb.ReplicateDirective(
            job=job, server=server, replica=name, replica_host=host, replica_address=address,
            div_max=div_max, resync=rejoin,
        )  # fmt: skip
        if rejoin:
            log.warning(
                "replica %r of server %r of job %r on %r registered again, unknown here (detached "
                "after the grace, or the scheduler restarted): re-syncing (its server's daemon "
                "sends it the model again)", name, server, job, host,
            )  # fmt: skip
        return [*out, (target.host, pb.Directive(replicate=d))]

    def lost(self, host: str, now: float) -> None:
        """``host``'s daemon lost its session: its replicas wait :attr:`grace` s for it."""
        for rec in self.records.values():
            if rec.host == host and rec.lost_at is None:
                rec.lost_at = now

    def next_deadline(self) -> float | None:
        """When the first replica whose daemon is away must be detached (None: none is away)."""
        return min(
            (r.lost_at + self.grace for r in self.records.values() if r.lost_at is not None),
            default=None,
        )

    def expire(self, now: float) -> Directives:
        """Detach the replicas whose daemon did not come back within the grace."""
        out: Directives = []
        for key, rec in list(self.records.items()):
            if rec.lost_at is not None and now >= rec.lost_at + self.grace:
                log.warning(
                    "replica %r of server %r of job %r: its daemon (host %r) did not come back "
                    "within %g s; detached (re-synced if it registers again)",
                    rec.name, rec.server, rec.job, rec.host, self.grace,
                )  # fmt: skip
                out += self.remove(*key)
        return out

    def applied(self, m: pb.ServerApplied) -> ReplicaRecord | None:
        """A ``ServerApplied``: one more entry the replica lacks."""
        rec = self.records.get((m.job, m.server))
        if rec is not None and m.version > rec.version:
            rec.log[int(m.version)] = (m.update_id, float(m.norm))
        return rec

    def status(self, m: pb.ReplicaStatus) -> ReplicaRecord | None:
        """A ``ReplicaStatus``: the replica's version, whether the server waits, errors."""
        rec = self.records.get((m.job, m.server))
        if rec is None:
            return None
        rec.confirmed = True
        rec.resyncing = False
        rec.version = max(rec.version, int(m.replica_version))
        rec.directed = max(rec.directed, rec.version)
        for v in [v for v in rec.log if v <= rec.version]:
            del rec.log[v]
        if m.blocked and not rec.blocked:
            rec.blocked_count += 1
        rec.blocked = bool(m.blocked)
        rec.error = m.error
        return rec

    def views(self) -> dict[tuple[str, str], ReplicaView]:
        """The policies' view of every replica whose server is registered."""
        views = {}
        for key, rec in self.records.items():
            server = next((s for s in self.state.servers(rec.job) if s.name == rec.server), None)
            if server is None:
                continue
            entries = tuple((uid, v, norm) for v, (uid, norm) in sorted(rec.log.items()))
            views[key] = ReplicaView(
                rec.job, rec.server, server.host, rec.host, rec.div_max, rec.version, rec.directed,
                entries, rec.blocked,
            )  # fmt: skip
        return views

    def execute(self, sends: Sequence[ReplicaSend]) -> Directives:
        """The ``ReplicateDirective`` of each server for a decision's replica sends (up to a version)."""
        up_to: dict[tuple[str, str], int] = {}
        for rec in self.records.values():
            ids = {uid: v for v, (uid, _) in rec.log.items()}
            for s in sends:
                if s.update_id in ids and s.replica == rec.host:
                    key = (rec.job, rec.server)
                    up_to[key] = max(up_to.get(key, 0), ids[s.update_id])
        out: Directives = []
        for key, version in sorted(up_to.items()):
            rec = self.records[key]
            if version <= rec.directed:
                continue
            rec.directed = version
            server = next(s for s in self.state.servers(rec.job) if s.name == rec.server)
            d = pb.ReplicateDirective(job=rec.job, server=rec.server, replica=rec.name, up_to_version=version)
            out.append((server.host, pb.Directive(replicate=d)))
        return out

    def remove(self, job: str, server: str) -> Directives:
        """The replica of ``server`` went away: forget it; detach it at the server's daemon."""
        rec = self.records.pop((job, server), None)
        target = next((s for s in self.state.servers(job) if s.name == server), None)
        if rec is None or target is None:
            return []
        d = pb.ReplicateDirective(job=job, server=server, replica=rec.name, detach=True)
        return [(target.host, pb.Directive(replicate=d))]


class Replication:
    """What the service does for replicas, as a pure book: every call returns :class:`~.effects.Effects`.

    It keeps the :class:`ReplicaBook` and the servers that failed over, builds the servers'
    ``ServerInfo`` (marked replicated, failed over) and the ``JobUpdate`` announcing them, runs
    the :class:`~mlfabric.scheduler.policies.replication.ReplicationPolicy` in each decision and
    promotes replicas (see the module docstring). Its waits, divergence, re-syncs and
    promotions are counted in the state's :class:`~.observe.Recorder`.

    Parameters
    ----------
    state : SchedulerState
        Daemons, jobs and servers (a promotion moves a server and re-routes its pending updates).
    runner : DecisionRunner
        Forgets the plans of the updates a promotion re-routes.
    grace : float
        Seconds a replica whose daemon lost its session stays attached (:data:`REREGISTER_GRACE`).

    Examples
    --------
    Server ``ps`` on ``h0``, a worker on ``h2``; a replica registers on ``h1``:

    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.records import JobParams
    >>> s = SchedulerState(star(["h0", "h1", "h2"], 8e9))
    >>> _ = [s.connect(h, f"127.0.0.1:{9000 + i}") for i, h in enumerate(("h0", "h1", "h2"))]
    >>> _ = s.register_server("h0", "j", "ps", (), JobParams(div_max=2.0), version=0)
    >>> _ = s.register_worker("h2", "j", "w")
    >>> from mlfabric.scheduler.policies.fair import FairPolicy
    >>> rep = Replication(s, DecisionRunner(FairPolicy()))
    >>> m = pb.RegisterRole(job="j", role=pb.ROLE_REPLICA, name="r", replica_of="ps")
    >>> [(h, d.WhichOneof("kind")) for h, d in rep.register("h1", m).directives]
    [('h0', 'replicate'), ('h2', 'job_update')]
    >>> rep.server_infos("j")[0].replicated
    True
    """

    def __init__(
        self, state: SchedulerState, runner: DecisionRunner, grace: float = REREGISTER_GRACE
    ) -> None:
        self.state = state
        self.runner = runner
        self.book = ReplicaBook(state, grace)
        self.policy = ReplicationPolicy()
        self.promotions = 0
        #: (job, server) -> the host it was on before its replica was promoted
        self.failed_over: dict[tuple[str, str], str] = {}

    def _resyncing(self, job: str, server: str, value: int) -> None:
        self.state.recorder.replica_resyncing[(job, server)] = value

    def register(self, host: str, m: pb.RegisterRole) -> Effects:
        """A ``RegisterRole`` with ``ROLE_REPLICA`` (raises :class:`SchedulerError` naming the problem)."""
        out = Effects(self.book.register(host, m.job, m.replica_of, m.name, list(m.model), rejoin=m.rejoin))
        rec = self.book.records[(m.job, m.replica_of)]
        self._resyncing(m.job, m.replica_of, 1 if rec.resyncing else 0)
        out += self.announce(m.job)  # workers' daemons learn the server is replicated
        return out

    def on_message(self, kind: str, m: pb.ServerApplied | pb.ReplicaStatus) -> Effects:
        """``server_applied`` / ``replica_status``: update the books, decide if it matters."""
        status = m if isinstance(m, pb.ReplicaStatus) else None
        rec = self.book.status(m) if isinstance(m, pb.ReplicaStatus) else self.book.applied(m)
        if rec is None:
            return Effects()
        key = (rec.job, rec.server)
        if status is not None and status.blocked:
            waits = self.state.recorder.replica_server_waits
            waits[key] = waits.get(key, 0) + 1
        if status is not None:
            self._resyncing(rec.job, rec.server, 0)
        self.state.recorder.replica_divergence[key] = rec.divergence()
        if status is not None and status.error:
            log.warning("replica %r of server %r of job %r: %s", rec.name, rec.server, rec.job, status.error)
        # the replication policy decides on it
        return Effects(replan=status is None or rec.blocked)

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Effects:
        """Run the replication policy on the snapshot: the directives of its replica sends."""
        views = self.book.views()
        if not views:
            return Effects()
        snapshot = Snapshot(
            snapshot.now, snapshot.graph, snapshot.in_flight, snapshot.server_versions, snapshot.tau_max,
            snapshot.aggregators, views,
        )  # fmt: skip
        return Effects(self.book.execute(self.policy.decide(snapshot, pending).replicas))

    def replica_left(self, job: str, server: str) -> Effects:
        """The replica's process unregistered."""
        out = Effects(self.book.remove(job, server))
        self._resyncing(job, server, 0)
        out += self.announce(job)
        return out

    def check_server(self, host: str, job: str, name: str) -> None:
        """A server registering on ``host``: refused (:class:`FailedOver`) if ``name`` failed over.

        The process that comes back after its server failed over (its host's daemon, or itself,
        restarted) must not become a second server of that name: it joins as the promoted
        server's replica instead (``register_as_server`` does so on this code).
        """
        old = self.failed_over.get((job, name))
        current = next((s for s in self.state.servers(job) if s.name == name), None)
        if old is not None and current is not None and current.host != host:
            raise FailedOver(
                f"server '{name}' of job '{job}' failed over from host '{old}' to its replica on host "
                f"'{current.host}'; join as its replica (mlfabric.register_as_replica)"
            )

    def server_infos(self, job: str) -> list[pb.ServerInfo]:
        """The job's servers as ``RoleAck``/``JobUpdate`` list them: marked replicated, or failed over."""
        infos = [wire.server_info(s, self.state.address(s.host)) for s in self.state.servers(job)]
        for info in infos:
            info.replicated = (job, info.name) in self.book.records
            info.failed_over_from = self.failed_over.get((job, info.name), "")
        return infos

    def announce(self, job: str) -> Effects:
        """The job's current servers (a ``JobUpdate``) to every daemon with a worker of it."""
        out = Effects()
        servers = self.server_infos(job)
        for host in sorted(self.state.worker_hosts(job)):
            out.send(host, pb.Directive(job_update=pb.JobUpdate(job=job, servers=servers)))
        return out

    def server_lost(self, job: str, server: str, reason: str) -> Effects | None:
        """Promote the replica of ``server`` if it has a connected one; None if it has none."""
        rec = self.book.records.get((job, server))
        if rec is None or not rec.confirmed or rec.host not in self.state.daemons:
            return None
        del self.book.records[(job, server)]
        old = self.state.server_role(job, server).host
        moved = self.state.promote(job, server, rec.host, rec.version)
        self.failed_over[(job, server)] = old
        self.runner.forget(moved)
        self.promotions += 1
        self.state.recorder.replica_promotions += 1
        log.warning(
            "server %r of job %r failed (%s): replica %r on %s promoted",
            server,
            job,
            reason,
            rec.name,
            rec.host,
        )
        out = Effects(requeued=len(moved))  # planned again at the replica's host
        out.send(rec.host, pb.Directive(promote=pb.PromoteDirective(job=job, server=server, reason=reason)))
        out += self.announce(job)
        return out

    def host_lost(self, host: str, now: float) -> Effects:
        """``host``'s daemon left: promote the replicas of its servers; its replicas wait for it.

        A replica whose daemon lost its session stays attached (its server's daemon keeps
        forwarding to it over the data plane, and the bound holds) for the book's grace
        (:data:`REREGISTER_GRACE` by default): a daemon that reconnects registers it again and
        it goes on as before (:meth:`ReplicaBook.register`); else it is detached
        (:meth:`expire`), and re-synced when its daemon registers it later. While its daemon
        is away it cannot be promoted. The core's release loop wakes for the grace's end
        (:meth:`next_deadline`).
        """
        out = Effects()
        for (job, server), _ in list(self.book.records.items()):
            target = next((s for s in self.state.servers(job) if s.name == server), None)
            if target is not None and target.host == host:
                promoted = self.server_lost(job, server, f"the daemon of host '{host}' disconnected")
                if promoted is not None:
                    out += promoted
        self.book.lost(host, now)
        return out

    def next_deadline(self) -> float | None:
        """When a replica whose daemon is away is to be detached (the core's release loop)."""
        return self.book.next_deadline()

    def expire(self, now: float) -> Effects:
        """Detach the replicas whose daemon did not register them again in time."""
        out = Effects()
        for host, d in self.book.expire(now):
            out.send(host, d)
            self._resyncing(d.replicate.job, d.replicate.server, 0)
            out += self.announce(d.replicate.job)
        return out
