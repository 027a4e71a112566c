"""The replica role on a daemon: registration with the model, promotion, re-sync (docs/replication.md).

``mlfabric.register_as_replica(job, server)`` sends ``RegisterReplicaRequest``; the daemon
registers ``ROLE_REPLICA`` with the scheduler (which checks the job, the server, the model
spec and that the server has no replica yet), fetches the server's model from the server's
daemon with a GET naming the replica — the server's daemon starts its replication log at the
version it answers — and hands the model to the process in the ``RegisterReply`` (memfd).
From then on the replica is a server role of this host flagged as a replica
(:class:`~mlfabric.daemon.roles.server.serving.ServerRoles`): it applies replicated entries
only, and ``get`` on this host is not answered from it. A ``PromoteDirective`` makes it the
server: the flag goes, the process learns it (``Promoted``) and keeps serving with the same
loop.

On the *server's* daemon the same role keeps the replication logs
(:class:`~mlfabric.daemon.roles.replica.log.ReplicationLogs`) that ``ReplicateDirective``
configures and directs.

**Re-sync.** A replica whose daemon was away from the scheduler longer than the grace was
detached (its server's log dropped); its daemon registers it again (``rejoin``) and the
scheduler sends the *server's* daemon a ``ReplicateDirective`` with ``resync`` — on the same
control stream as the detach before it, so in order. :meth:`ReplicaRole.send_resync` starts a
new log at the server's current model and sends that model to the replica's daemon (a MODEL
frame naming the replica, with the ids the server applied recently);
:meth:`ReplicaRole.receive_resync` hands it to the replica process (``Resynced``), which
replaces its model; then the log forwards from that version and reports, and the scheduler
confirms the replica again.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from mlfabric.daemon.channels.frames import Frame, FrameHeader, error_header
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.channels.peers import PeerPool, PeerUnavailable
from mlfabric.daemon.channels.routing import FrameRoute
from mlfabric.daemon.roles.base import Role, RoleContext, Routes, already_registered, model_reply, refused
from mlfabric.daemon.roles.directory import Directory, ServerLocation
from mlfabric.daemon.roles.registrar import Registrar
from mlfabric.daemon.roles.replica.log import ReplicationLog, ReplicationLogs, copy_payload, seed_memory
from mlfabric.daemon.roles.server.handoff import ModelSnapshot
from mlfabric.daemon.roles.server.serving import ServerRoles
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.wire.memfd import PooledBuffer, allocate
from mlfabric.wire.tensors import layouts_to_pb

__all__ = ["ReplicaRole"]

_LOG = logging.getLogger("mlfabric.daemon")
_GET = dataplane_pb2.FRAME_KIND_GET
_MODEL = dataplane_pb2.FRAME_KIND_MODEL
_ACK = dataplane_pb2.FRAME_KIND_ACK
#: a replica whose server's daemon is not back yet is registered again (with backoff)
_NOT_BACK_YET = (control_pb2.ERROR_CODE_UNKNOWN_JOB, control_pb2.ERROR_CODE_UNKNOWN_SERVER)


class ReplicaRole(Role):
    """The replicas of this host's processes, and the replication logs of its servers (thread-safe).

    Parameters
    ----------
    context : RoleContext
        Host, scheduler session, task pool, stopping flag.
    registrar : Registrar
        Registers the replicas with the scheduler.
    directory : Directory
        Where every job's servers are (a promoted replica is added).
    serving : ServerRoles
        The server roles of this host (a replica is one, flagged until promoted).
    replication : ReplicationLogs
        The replication logs of this host's servers that have a replica.
    peers : PeerPool
        The data plane's way out (model fetches and re-syncs).
    """

    def __init__(
        self,
        context: RoleContext,
        registrar: Registrar,
        directory: Directory,
        serving: ServerRoles,
        replication: ReplicationLogs,
        peers: PeerPool,
    ) -> None:
        self._ctx = context
        self._registrar = registrar
        self._directory = directory
        self._serving = serving
        self.replication = replication
        self._peers = peers

    def routes(self) -> Routes:
        return Routes(
            requests={"register_replica": self.register},
            frames={FrameRoute.REPLICA_RESYNC: self.receive_resync},
            directives={"replicate": self.on_replicate, "promote": self.promote},
        )

    def stop(self) -> None:
        """Close every replication log (the servers' daemon is shutting down)."""
        self.replication.close_all()

    def _unregister(self, job: str, server: str) -> None:
        message = control_pb2.UnregisterRole(job=job, role=control_pb2.ROLE_REPLICA, name=server)
        self._ctx.send(control_pb2.DaemonMessage(unregister_role=message))

    # ------------------------------------------------------------------ registration

    def register(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """``RegisterReplicaRequest``: register with the scheduler, then attach (on the task pool)."""
        req, rid = request.register_replica, request.request_id
        if already_registered(conn, rid):
            return fd
        if not req.job or not req.server:
            conn.error(rid, "bad_request", "register_as_replica needs a job and a server name")
            return fd
        message = control_pb2.RegisterRole(
            job=req.job,
            role=control_pb2.ROLE_REPLICA,
            name=req.name or req.server,
            replica_of=req.server,
            model=req.model,
        )

        def on_ack(ack: Any) -> None:
            if not refused(conn, rid, ack, self._ctx):
                self._ctx.submit(self._attach, conn, rid, req, ack)

        self._registrar.register(message, on_ack)
        return fd

    def _attach(self, conn: LocalConnection, rid: int, req: Any, ack: Any) -> None:
        """Fetch the server's model (attaching this replica) and take the replica role."""
        where = f"server {req.server!r} of job {req.job!r}"
        server = next((s for s in ack.servers if s.name == req.server), None)
        if server is None:
            conn.error(
                rid,
                "unknown_server",
                f"{where} is not among the job's servers {[s.name for s in ack.servers]}",
            )
            self._unregister(req.job, req.server)
            return
        name = req.name or req.server
        header = dataplane_pb2.FrameHeader(
            kind=_GET, job=req.job, server=req.server, src_host=self._ctx.host, replica=name
        )
        try:
            reply = self._peers.request(server.data_address, header, alloc=allocate)
        except PeerUnavailable as exc:
            conn.error(
                rid, "unavailable", f"replica of {where}: model fetch from {server.host!r} failed: {exc}"
            )
            self._unregister(req.job, req.server)
            return
        buffer = reply.memfd()
        try:
            h = reply.header
            if h.kind != _MODEL:
                conn.error(
                    rid, "unavailable", f"replica of {where}: the server's daemon answered {h.reason!r}"
                )
                self._unregister(req.job, req.server)
                return
            register = local_pb2.RegisterServerRequest(
                job=req.job, name=req.server, model=server.model, params=ack.params, version=h.version
            )
            taken = self._serving.add(conn, register, replica=name)
            if taken is not None:
                conn.error(rid, "refused", taken)
                self._unregister(req.job, req.server)
                return
            handoff = self._serving.handoff(req.job, req.server)
            assert handoff is not None
            seed_memory(handoff, h.applied_ids, int(h.version))
            self._directory.update(req.job, ack.servers)
            registered = local_pb2.RegisterReply(params=ack.params, servers=ack.servers, model=model_reply(h))
            conn.send(local_pb2.LocalEvent(request_id=rid, registered=registered), buffer.fd)
        finally:
            buffer.release()

    def register_again(self) -> None:
        """After a (re)welcome: register this host's replicas again (the scheduler forgot them).

        A replica whose server is not back yet (``UNKNOWN_JOB``/``UNKNOWN_SERVER``: its daemon
        has not reconnected) is registered again with backoff, as long as it is a replica here.
        """
        for job, server in self._serving.replicas():
            name = self._serving.replica_name(job, server)
            if name is None:
                continue  # promoted or gone meanwhile
            message = control_pb2.RegisterRole(
                job=job, role=control_pb2.ROLE_REPLICA, name=name, replica_of=server, rejoin=True
            )
            self._registrar.register_until(
                message,
                functools.partial(self._registered_again, job, server),
                retry=_NOT_BACK_YET,
                wanted=functools.partial(self._still_replica, job, server),
            )

    def _still_replica(self, job: str, server: str) -> bool:
        return self._serving.replica_name(job, server) is not None

    def _registered_again(self, job: str, server: str, ack: Any) -> None:
        if ack is None or (not ack.ok and ack.code not in _NOT_BACK_YET):
            _LOG.error(
                "re-registering the replica of server %r of job %r failed: %s", server, job, ack and ack.error
            )

    # ------------------------------------------------------------------ directives

    def on_replicate(self, d: Any) -> None:
        """A ``ReplicateDirective``: a re-sync (sends the model: on the task pool), or the log's."""
        if d.resync and not d.detach:
            self._ctx.submit(self.send_resync, d)
        else:
            self.replication.on_directive(d)

    def promote(self, d: Any) -> bool:
        """A ``PromoteDirective``: the replica of ``d.server`` here becomes the server. False if none."""
        conn = self._serving.promote(d.job, d.server)
        if conn is None:
            _LOG.warning("promote directive for server %r of job %r: no replica of it here", d.server, d.job)
            return False
        handoff = self._serving.handoff(d.job, d.server)
        assert handoff is not None
        location = ServerLocation(
            d.server, self._ctx.host, self._ctx.data_address, handoff.spec, handoff.version
        )
        self._directory.add(d.job, location)
        _LOG.warning("replica of server %r of job %r promoted: %s", d.server, d.job, d.reason)
        conn.send(
            local_pb2.LocalEvent(promoted=local_pb2.Promoted(job=d.job, server=d.server, reason=d.reason))
        )
        return True

    # ------------------------------------------------------------------ re-sync

    def send_resync(self, d: Any) -> bool:
        """A ``ReplicateDirective`` with ``resync`` on the server's daemon: send the replica the model.

        Under the hand-off's lock a new log starts at the version of the model published now (as
        a replica's GET does at registration), silent until the replica has that model; the
        model goes to the replica's daemon in a MODEL frame naming the replica, with the ids the
        server applied recently. Once the replica's daemon acknowledged it, the log is configured
        (address, ``div_max``), forwards from that version and reports (the scheduler confirms the
        replica). True if the replica has the model; on failure the new log is dropped (the
        server does not wait on a replica that lacks it) and the replica stays unconfirmed.
        """
        where = f"replica {d.replica!r} of server {d.server!r} of job {d.job!r}"
        handoff = self._serving.handoff(d.job, d.server)
        if handoff is None:
            _LOG.warning("re-sync of %s: the server is not on this host", where)
            return False
        logs = self.replication
        started: list[ReplicationLog] = []

        def attach(current: ModelSnapshot | None) -> ModelSnapshot | None:
            if current is not None:  # under the hand-off's lock: no publish in between
                started.append(logs.attach(d.job, d.server, d.replica, current.version, announce=False))
            return current

        snap = handoff.with_snapshot(attach)
        if snap is None or not started:
            _LOG.warning("re-sync of %s: the server has published no model", where)
            return False
        log = started[0]
        header = FrameHeader(
            kind=_MODEL,
            job=d.job,
            server=d.server,
            version=snap.version,
            tensors=layouts_to_pb(snap.layouts),
            src_host=self._ctx.host,
            applied_ids=handoff.verdicts.applied_ids(4096),
            replica=d.replica,
        )
        try:
            reply = self._peers.request(d.replica_address, header, snap.mapping, crc32=snap.checksum())
            reply.release()
            problem = "" if reply.header.kind == _ACK else f"its daemon answered {reply.header.reason!r}"
        except ConnectionError as exc:  # PeerUnavailable, a broken connection
            problem = f"its daemon at {d.replica_address} is unreachable: {exc}"
        if problem:
            _LOG.warning("re-sync of %s failed (stays unconfirmed, not waited on): %s", where, problem)
            logs.drop(d.job, d.server, log)
            return False
        log.configure(d.replica_address, d.div_max)
        log.direct(d.up_to_version)
        log.report_status()
        _LOG.warning("%s re-synced at version %d", where, snap.version)
        return True

    def receive_resync(self, frame: Frame) -> Response:
        """A MODEL frame naming a replica of this host (:meth:`send_resync`): replace its model.

        The hand-off's version moves to the model's (the next replicated entry is the one after
        it) and the ids the server applied are remembered; the process gets ``Resynced`` (a
        private memfd copy of the payload) before any entry of the new log, which the server's
        daemon forwards only after this ACK.
        """
        h = frame.header
        host = self._ctx.host
        try:
            entry = self._serving.replica(h.job, h.server)
            if entry is None or not isinstance(frame.buffer, PooledBuffer):
                reason = f"no replica of server {h.server!r} of job {h.job!r} on host {host!r}"
                return Response(error_header(reason, src_host=host))
            handoff, conn = entry
            fd = copy_payload(frame.buffer.fd, int(h.payload_bytes))
            event = local_pb2.LocalEvent(
                resynced=local_pb2.Resynced(job=h.job, server=h.server, model=model_reply(h))
            )
            try:
                # no entry of an older log is handed over between the version check and the model
                with handoff.replicating:
                    if not conn.send(event, fd):
                        reason = f"replica process of server {h.server!r} of job {h.job!r} disconnected"
                        return Response(error_header(reason, src_host=host))
                    handoff.verdicts.advance(int(h.version))
                    seed_memory(handoff, h.applied_ids, int(h.version))
            finally:
                os.close(fd)
            _LOG.warning("replica of server %r of job %r re-synced at version %d", h.server, h.job, h.version)
            return Response(
                FrameHeader(kind=_ACK, job=h.job, server=h.server, version=h.version, src_host=host)
            )
        finally:
            frame.release()
