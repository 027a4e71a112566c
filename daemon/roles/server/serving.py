"""The server role: servers (and replicas) of this host, hand-off of arriving updates, the model.

On the server's host the daemon passes each update arriving on the data plane (its memfd,
filled by the data plane's ``alloc``) to the server process as ``DeliverUpdate``, waits for
the process's ``UpdateVerdict`` and answers the sender with an ACK frame carrying it. A
retried update gets the stored verdict (each server's
:class:`~mlfabric.daemon.roles.server.verdicts.VerdictStore`), so it is never applied twice;
aggregates and synchronous rounds pass through
:class:`~mlfabric.daemon.roles.server.rounds.ServerAggregation` first. ``get`` — a GET frame
from a peer daemon, or a local worker's request — is answered from the model the server
process last published (``PublishModel``, a memfd kept mapped, its CRC-32 computed at the
first GET). A replica of a server is a server role here flagged as a replica until it is
promoted (:mod:`mlfabric.daemon.roles.replica`).
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.channels.frames import (
    Frame,
    FrameError,
    FrameHeader,
    FrameLimits,
    check_header,
    error_header,
    non_finite_reason,
)
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.channels.routing import FrameRoute
from mlfabric.daemon.roles.base import Role, RoleContext, Routes, Verdict, already_registered, refused
from mlfabric.daemon.roles.directory import Directory, ServerLocation, spec_from_pb
from mlfabric.daemon.roles.registrar import Registrar
from mlfabric.daemon.roles.replica.log import ReplicationLogs, apply_replicated
from mlfabric.daemon.roles.server.handoff import ModelSnapshot, ServerHandoff
from mlfabric.daemon.roles.server.rounds import ServerAggregation
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.wire.memfd import PooledBuffer, allocate
from mlfabric.wire.tensors import check_update, layouts_from_pb, layouts_to_pb

__all__ = ["ServerRoles"]

_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_ACK = dataplane_pb2.FRAME_KIND_ACK
_GET = dataplane_pb2.FRAME_KIND_GET
_MODEL = dataplane_pb2.FRAME_KIND_MODEL

#: seconds a worker's update arriving at a replica here waits for the replica's promotion: the
#: scheduler promotes the replica and re-routes the failed server's updates at once, and the
#: first of them may overtake the ``PromoteDirective`` (docs/replication.md)
PROMOTION_WAIT = 3.0


class ServerRoles(Role):
    """The server roles on one host, keyed by (job, server name) (thread-safe).

    Parameters
    ----------
    context : RoleContext
        This host (its name and data-plane address in messages), the scheduler session.
    registrar : Registrar
        Registers the servers with the scheduler.
    directory : Directory
        Where every job's servers are (a server registered here is added).
    limits : FrameLimits
        What a published model may be.
    verdict_timeout : float or None
        Seconds to wait for a server process's verdict (None: until it answers or disconnects).
    replication : ReplicationLogs, optional
        The replication logs of the servers here that have a replica (docs/replication.md).
    alloc : callable
        ``alloc(nbytes)`` -> a memfd buffer for a synchronous round's sum.
    round_timeout : float
        Seconds a synchronous round waits for its missing workers.
    """

    def __init__(
        self,
        context: RoleContext,
        registrar: Registrar,
        directory: Directory,
        limits: FrameLimits,
        verdict_timeout: float | None,
        *,
        replication: ReplicationLogs | None = None,
        alloc: Callable[[int], Any] = allocate,
        round_timeout: float = 60.0,
    ) -> None:
        self._ctx = context
        self.host = context.host
        self._registrar = registrar
        self._directory = directory
        self._limits = limits
        self._verdict_timeout = verdict_timeout
        #: aggregates' members and synchronous rounds
        self.aggregation = ServerAggregation(alloc, round_timeout, context.clock)
        self._lock = threading.Lock()
        #: notified when a replica here is promoted (an update may arrive just before)
        self._promoted = threading.Condition(self._lock)
        self._roles: dict[tuple[str, str], tuple[ServerHandoff, LocalConnection, Any]] = {}
        #: replicas hosted here (keyed like their servers) not promoted yet -> their names
        self._replicas: dict[tuple[str, str], str] = {}
        self.replication = replication
        #: ids of updates being handed off whose payload was found finite in the CRC pass
        self._finite_checked: set[str] = set()

    def routes(self) -> Routes:
        return Routes(
            requests={"register_server": self.register, "verdict": self.verdict, "publish": self.publish},
            # a GET goes to the model relays (roles/relay), which answer it from here for a
            # server of this host (answer_get) and from their cache for another
            frames={FrameRoute.UPDATE: self.on_frame},
        )

    @property
    def processes(self) -> int:
        """Server and replica processes registered here."""
        with self._lock:
            return len(self._roles)

    # ------------------------------------------------------------------ registration

    def register(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """``RegisterServerRequest``: register with the scheduler, then host the server here."""
        req, rid = request.register_server, request.request_id
        if already_registered(conn, rid):
            return fd
        message = control_pb2.RegisterRole(
            job=req.job,
            name=req.name,
            role=control_pb2.ROLE_SERVER,
            model=req.model,
            params=req.params,
            version=req.version,
        )

        def on_ack(ack: Any) -> None:
            if refused(conn, rid, ack, self._ctx):
                return
            taken = self.add(conn, req)
            if taken is not None:
                conn.error(rid, "refused", taken)
                return
            spec = spec_from_pb(req.model)
            self._directory.update(req.job, ack.servers)
            location = ServerLocation(req.name, self.host, self._ctx.data_address, spec, req.version)
            self._directory.add(req.job, location)
            reply = local_pb2.RegisterReply(params=req.params, servers=ack.servers)
            conn.send(local_pb2.LocalEvent(request_id=rid, registered=reply))

        self._registrar.register(message, on_ack)
        return fd

    def add(self, conn: LocalConnection, req: Any, *, replica: str | None = None) -> str | None:
        """Host server ``req`` (a ``RegisterServerRequest``) for ``conn``; an error message if taken.

        ``replica``: ``conn`` is the replica of that server with this name (it applies only
        replicated entries until :meth:`promote`).
        """
        key = (req.job, req.name)

        def deliver(update_id: str, header: Any, payload_fd: int) -> None:
            event = local_pb2.LocalEvent(
                deliver=local_pb2.DeliverUpdate(
                    update_id=update_id,
                    worker=header.worker,
                    base_version=header.base_version,
                    norm=header.norm,
                    num_updates=header.num_updates or 1,
                    tensors=header.tensors,
                    payload_bytes=header.payload_bytes,
                    has_payload=True,
                    members=header.members,
                    # the daemon's view at hand-off; the process computes them at apply time
                    member_delays=[handoff.version - m.base_version for m in header.members],
                    replicated=bool(getattr(header, "replica_version", 0)),
                    want_norm=self.replication is not None
                    and self.replication.get(req.job, req.name) is not None,
                    finite_checked=update_id in self._finite_checked,
                )
            )
            if not conn.send(event, payload_fd):
                raise ConnectionError(f"server process {req.name!r} disconnected")

        with self._lock:
            if key in self._roles:
                return f"server {req.name!r} of job {req.job!r} already runs on host {self.host!r}"
            conn.role, conn.job, conn.name = "server", req.job, req.name
            handoff = ServerHandoff(req.job, req.name, spec_from_pb(req.model), req.version, deliver)
            self._roles[key] = (handoff, conn, req.params)
            if replica is not None:
                self._replicas[key] = replica
        return None

    def register_again(self) -> None:
        """Register every server hosted here again, at its current version (not the replicas)."""
        with self._lock:
            entries = [e for k, e in self._roles.items() if k not in self._replicas]
        for handoff, _, params in entries:
            message = control_pb2.RegisterRole(
                job=handoff.job,
                name=handoff.name,
                role=control_pb2.ROLE_SERVER,
                params=params,
                version=handoff.version,
                model=[
                    control_pb2.TensorSpec(name=n, dtype=d, shape=list(s))
                    for n, (d, s) in handoff.spec.items()
                ],
            )
            self._registrar.register(
                message, functools.partial(self._registrar.log_answer, handoff.job, handoff.name)
            )

    def connection_closed(self, conn: LocalConnection) -> None:
        """A server (or replica) process went away: drop what waits for it, tell the scheduler."""
        if conn.role != "server":
            return
        replica = self.is_replica(conn)
        self.remove(conn)
        role = control_pb2.ROLE_REPLICA if replica else control_pb2.ROLE_SERVER
        message = control_pb2.UnregisterRole(job=conn.job, role=role, name=conn.name)
        self._ctx.send(control_pb2.DaemonMessage(unregister_role=message))

    def stop(self) -> None:
        """Resolve every waiting hand-off (the daemon is shutting down)."""
        self.close_all(f"daemon of host {self.host!r} shut down")

    # ------------------------------------------------------------------ the servers and replicas here

    def handoff(self, job: str, server: str) -> ServerHandoff | None:
        """The hand-off of server (or replica) ``server`` of ``job`` here, or None."""
        with self._lock:
            entry = self._roles.get((job, server))
        return entry[0] if entry is not None else None

    def hosts(self, job: str, server: str) -> bool:
        """Whether server ``server`` of ``job`` runs on this host (not as a replica)."""
        with self._lock:
            return (job, server) in self._roles and (job, server) not in self._replicas

    def is_replica(self, conn: LocalConnection) -> bool:
        """Whether ``conn`` is a replica here that has not been promoted."""
        with self._lock:
            entry = self._roles.get((conn.job, conn.name))
            return entry is not None and entry[1] is conn and (conn.job, conn.name) in self._replicas

    def replicas(self) -> list[tuple[str, str]]:
        """(job, server) of every replica here not promoted yet, sorted."""
        with self._lock:
            return sorted(self._replicas)

    def replica_name(self, job: str, server: str) -> str | None:
        """The name of the replica of ``server`` here, or None if there is none (any more)."""
        with self._lock:
            return self._replicas.get((job, server))

    def replica(self, job: str, server: str) -> tuple[ServerHandoff, LocalConnection] | None:
        """The hand-off and connection of the replica of ``server`` here, or None."""
        with self._lock:
            entry = self._roles.get((job, server)) if (job, server) in self._replicas else None
        return None if entry is None else (entry[0], entry[1])

    def promote(self, job: str, server: str) -> LocalConnection | None:
        """The replica of ``server`` here becomes the server; its connection, or None if none."""
        with self._lock:
            if self._replicas.pop((job, server), None) is None:
                return None
            self._promoted.notify_all()
            return self._roles[(job, server)][1]

    def remove(self, conn: LocalConnection) -> bool:
        """The server process of ``conn`` went away: drop what waits for it. True if it had a role."""
        with self._lock:
            entry = self._roles.get((conn.job, conn.name))
            if entry is None or entry[1] is not conn:
                return False
            del self._roles[(conn.job, conn.name)]
            self._replicas.pop((conn.job, conn.name), None)
        if self.replication is not None:
            self.replication.close(conn.job, conn.name)
        entry[0].close(f"server process {conn.name!r} of job {conn.job!r} on host {self.host!r} disconnected")
        return True

    def close_all(self, reason: str) -> None:
        """Resolve every waiting hand-off DROPPED with ``reason`` (shutdown)."""
        with self._lock:
            entries = list(self._roles.values())
            self._roles.clear()
        for handoff, _, _ in entries:
            handoff.close(reason)

    def _own(self, conn: LocalConnection) -> ServerHandoff | None:
        with self._lock:
            entry = self._roles.get((conn.job, conn.name)) if conn.role == "server" else None
        return entry[0] if entry is not None and entry[1] is conn else None

    # ------------------------------------------------------------------ from the server process

    def verdict(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """An ``UpdateVerdict`` from a server process: wake the senders waiting for it."""
        handoff = self._own(conn)
        if handoff is None:
            conn.error(request.request_id, "bad_request", "verdict from a connection that is not a server")
            return fd
        v = request.verdict
        if v.has_norm and self.replication is not None:
            self.replication.note_norm(v.update_id, v.norm)
        handoff.verdicts.resolve(v.update_id, Verdict(v.outcome, v.delay, v.version, v.reason))
        return fd

    def publish(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """A ``PublishModel`` from a server process: ``get`` answers from it from now on."""
        p, rid = request.publish, request.request_id
        handoff = self._own(conn)
        if handoff is None or fd is None:
            conn.error(rid, "bad_request", "publish needs a registered server connection and a model memfd")
            return fd
        try:
            header = FrameHeader(kind=_MODEL, payload_bytes=p.payload_bytes, tensors=p.tensors)
            check_header(header, self._limits)
        except FrameError as exc:
            conn.error(rid, "bad_tensor", f"published model: {exc}")
            return fd
        if os.fstat(fd).st_size < p.payload_bytes:
            conn.error(rid, "bad_tensor", f"published model memfd is shorter than {p.payload_bytes} bytes")
            return fd
        mapping = mmap.mmap(fd, p.payload_bytes, prot=mmap.PROT_READ) if p.payload_bytes else None
        # the CRC-32 waits for the first peer GET: computing it here would delay the verdict
        handoff.publish(ModelSnapshot(p.version, layouts_from_pb(p.tensors), p.payload_bytes, fd, mapping))
        return None

    def send_model(self, conn: LocalConnection, rid: int, job: str, server: str) -> None:
        """Answer a local ``get`` for a server on this host (the memfd goes to the process)."""
        with self._lock:
            entry = self._roles.get((job, server))
        if entry is None:
            conn.error(rid, "unavailable", f"server {server!r} of job {job!r} is not on host {self.host!r}")
            return

        def send(snap: ModelSnapshot | None) -> None:
            if snap is None:
                conn.error(rid, "unavailable", f"server {server!r} of job {job!r} has not published a model")
                return
            conn.send(snap.local_event(rid), snap.fd)

        entry[0].with_snapshot(send)

    # ------------------------------------------------------------------ from the data plane

    def on_frame(self, frame: Frame) -> Response:
        """The data-plane handler: UPDATE -> ACK (the verdict), GET -> MODEL, else ERROR."""
        h = frame.header
        try:
            if h.kind == _UPDATE:
                return self._on_update(frame)
            if h.kind == _GET:
                return self.answer_get(h)
            return self._error(f"unexpected frame kind {h.kind}", h.update_id)
        finally:
            frame.release()  # a pooled buffer goes back for the next frame

    def _error(self, reason: str, update_id: str = "") -> Response:
        return Response(error_header(reason, update_id=update_id, src_host=self.host))

    def _on_update(self, frame: Frame) -> Response:
        h = frame.header
        with self._lock:
            entry = self._roles.get((h.job, h.server))
        if entry is None:
            return self._error(f"no server {h.server!r} of job {h.job!r} on host {self.host!r}", h.update_id)
        handoff = entry[0]
        is_replica = (h.job, h.server) in self._replicas
        if is_replica and not h.replica_version:  # a worker's update: the promotion may be on its way
            with self._lock:
                self._promoted.wait_for(lambda: (h.job, h.server) not in self._replicas, PROMOTION_WAIT)
                is_replica = (h.job, h.server) in self._replicas
        where = f"server {h.server!r} of job {h.job!r}"
        if is_replica != bool(h.replica_version):
            what = "is only a replica here" if is_replica else "is served here, not replicated"
            return self._error(f"{where} {what} (host {self.host!r})", h.update_id)
        problem = check_update(handoff.spec, layouts_from_pb(h.tensors), where)
        negative = [b for b in (h.base_version, *(m.base_version for m in h.members)) if b < 0]
        if problem is None and negative:
            problem = f"base_version {negative[0]} is negative: a model version is 0 or more"
        if problem is not None:
            return self._error(problem, h.update_id)

        def hand_off(update_id: str, header: Any, given: Any) -> Verdict:
            buffer = given
            if not isinstance(buffer, PooledBuffer):
                buffer = allocate(0)  # an empty payload: the process still gets a memfd
            logs = self.replication
            log = logs.get(h.job, h.server) if logs is not None else None
            reserved = log.admit(float(header.norm)) if log is not None else 0.0
            # checked in the CRC pass and finite: the process need not read it for that
            checked = given is frame.buffer and frame.finite_checked and frame.non_finite is None
            if checked:
                self._finite_checked.add(update_id)
            try:
                verdict = handoff.handle(update_id, header, buffer.fd, self._verdict_timeout)
                log = logs.get(h.job, h.server) if logs is not None else None  # may attach meanwhile
                if log is not None and logs is not None:
                    norm = logs.take_norm(update_id, float(header.norm))
                    nbytes = int(header.payload_bytes)
                    verdict = log.settle(reserved, update_id, header, verdict, buffer.fd, nbytes, norm)
                return verdict
            finally:
                if checked:
                    self._finite_checked.discard(update_id)
                if buffer is not given:
                    buffer.release()  # the empty stand-in
                elif isinstance(buffer, PooledBuffer) and handoff.verdicts.in_flight(update_id):
                    buffer.discard()  # no verdict yet (timeout): the process may still read it
                elif given is not frame.buffer:
                    given.release()  # a synchronous round's sum (the frame's buffer: on_frame's)

        try:
            if h.replica_version:
                verdict = apply_replicated(handoff, h, lambda: hand_off(h.update_id, h, frame.buffer))
                members: list[Any] = []
            elif frame.non_finite is not None and not (entry[2] is not None and entry[2].allow_non_finite):
                # found in the CRC pass: refused here, never handed to the process (nor summed)
                reason = non_finite_reason(frame.non_finite, h.update_id, f"server {h.server!r}")
                verdict, members = self.aggregation.refuse(frame, handoff, reason)
            else:
                verdict, members = self.aggregation.handle(frame, handoff, entry[2], hand_off)
        except ValueError as exc:  # a payload that cannot be summed into the open round
            return self._error(str(exc), h.update_id)
        if not verdict.handed_over and not h.replica_version and not h.members:
            # the process was gone before the hand-off: answer as a host without the server does
            # (an ERROR, not a DROPPED ACK), so that the sender's daemon re-routes the update to
            # the promoted replica if the server fails over (it was certainly not applied)
            return self._error(verdict.reason, h.update_id)
        ack = FrameHeader(
            kind=_ACK,
            update_id=h.update_id,
            job=h.job,
            server=h.server,
            outcome=verdict.outcome,
            delay=verdict.delay,
            version=verdict.version,
            reason=verdict.reason,
            src_host=self.host,
            receive_seconds=frame.stats.seconds,
            aggregate_id=h.aggregate_id,
            member_verdicts=members,
        )
        return Response(ack)

    def answer_get(self, h: Any) -> Response:
        """A GET frame's answer from the model a server (or replica) here published (or ERROR)."""
        with self._lock:
            entry = self._roles.get((h.job, h.server))
        snap = entry[0].snapshot() if entry is not None else None
        applied_ids: list[str] = []
        if snap is not None and h.replica and self.replication is not None and entry is not None:
            # a replica attaches: its log starts at the version of the model it gets
            handoff, logs = entry[0], self.replication

            def attach(current: ModelSnapshot | None) -> ModelSnapshot | None:
                if current is not None:  # under the hand-off's lock: no publish in between
                    logs.attach(h.job, h.server, h.replica, current.version)
                return current

            snap = handoff.with_snapshot(attach)
            applied_ids = handoff.verdicts.applied_ids(4096)
        if snap is None:
            return self._error(f"no model of server {h.server!r} of job {h.job!r} on host {self.host!r}")
        header = FrameHeader(
            kind=_MODEL,
            job=h.job,
            server=h.server,
            version=snap.version,
            tensors=layouts_to_pb(snap.layouts),
            src_host=self.host,
            applied_ids=applied_ids,
        )
        # The mapping (not the fd) backs the reply: a publish may close the fd meanwhile.
        return Response(header, snap.mapping, crc32=snap.checksum())
