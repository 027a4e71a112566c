"""The replica role on a daemon: registration with the model, promotion (docs/replication.md).

``mlfabric.register_as_replica(job, server)`` sends ``RegisterReplicaRequest``; the daemon
registers ``ROLE_REPLICA`` with the scheduler (which checks the job, the server, the model
spec and that the server has no replica yet), fetches the server's model from the server's
daemon with a GET naming the replica — the server's daemon starts its replication log at the
version it answers — and hands the model to the process in the ``RegisterReply`` (memfd).
From then on the replica is a server role of this host flagged as a replica
(:class:`~mlfabric.daemon.roles.server.serving.ServerRoles`): it applies replicated entries only, and
``get`` on this host is not answered from it. A ``PromoteDirective`` makes it the server:
the flag goes, the process learns it (``Promoted``) and keeps serving with the same loop.

**Re-sync.** A replica whose daemon was away from the scheduler longer than the grace was
detached (its server's log dropped); its daemon registers it again (``rejoin``) and the
scheduler sends the *server's* daemon a ``ReplicateDirective`` with ``resync`` — on the same
control stream as the detach before it, so in order. :func:`send_resync` starts a new log at
the server's current model and sends that model to the replica's daemon (a MODEL frame naming
the replica, with the ids the server applied recently); :func:`receive_resync` hands it to
the replica process (``Resynced``), which replaces its model; then the log forwards from that
version and reports, and the scheduler confirms the replica again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.channels.control import local_error_code
from mlfabric.daemon.channels.frames import Frame, FrameHeader, error_header
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.peers import PeerUnavailable
from mlfabric.daemon.roles.directory import ServerLocation
from mlfabric.daemon.roles.replica.log import ReplicationLog, copy_payload, seed_memory
from mlfabric.daemon.roles.server.handoff import ModelSnapshot
from mlfabric.daemon.roles.worker.pushes import PendingPush
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.wire.memfd import PooledBuffer, allocate
from mlfabric.wire.tensors import layouts_to_pb

__all__ = [
    "FAILOVER_WAIT",
    "promote",
    "receive_resync",
    "register_replica",
    "reregister_replicas",
    "reroute",
    "send_resync",
]

#: seconds an update whose transfer to a replicated server failed waits for the failover
FAILOVER_WAIT = 3.0

_LOG = logging.getLogger("mlfabric.daemon")
_GET = dataplane_pb2.FRAME_KIND_GET
_MODEL = dataplane_pb2.FRAME_KIND_MODEL
_ACK = dataplane_pb2.FRAME_KIND_ACK


def _unregister(daemon: Any, job: str, server: str) -> None:
    message = control_pb2.UnregisterRole(job=job, role=control_pb2.ROLE_REPLICA, name=server)
    daemon._control.send(control_pb2.DaemonMessage(unregister_role=message))


def register_replica(daemon: Any, conn: Any, request: Any, fd: int | None) -> int | None:
    """Handle a ``RegisterReplicaRequest`` of ``conn`` (a local request handler of ``daemon``)."""
    req, rid = request.register_replica, request.request_id
    if conn.role:
        conn.error(rid, "bad_request", f"this connection is already registered as {conn.role} {conn.name!r}")
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
        if ack is None or not ack.ok:
            error = (
                ack.error if ack is not None else f"scheduler at {daemon.config.scheduler} is not connected"
            )
            conn.error(rid, "unavailable" if ack is None else local_error_code(ack.code), error)
            return
        daemon._tasks.submit(_attach, daemon, conn, rid, req, ack)

    daemon._register(message, on_ack)
    return fd


def _attach(daemon: Any, conn: Any, rid: int, req: Any, ack: Any) -> None:
    """Fetch the server's model (attaching this replica) and take the replica role."""
    where = f"server {req.server!r} of job {req.job!r}"
    server = next((s for s in ack.servers if s.name == req.server), None)
    if server is None:
        conn.error(
            rid, "unknown_server", f"{where} is not among the job's servers {[s.name for s in ack.servers]}"
        )
        _unregister(daemon, req.job, req.server)
        return
    header = dataplane_pb2.FrameHeader(
        kind=_GET, job=req.job, server=req.server, src_host=daemon.host, replica=req.name or req.server
    )
    try:
        reply = daemon._pool.request(server.data_address, header, alloc=allocate)
    except PeerUnavailable as exc:
        conn.error(rid, "unavailable", f"replica of {where}: model fetch from {server.host!r} failed: {exc}")
        _unregister(daemon, req.job, req.server)
        return
    buffer = reply.buffer if isinstance(reply.buffer, PooledBuffer) else allocate(0)
    reply.payload.release()
    try:
        h = reply.header
        if h.kind != _MODEL:
            conn.error(rid, "unavailable", f"replica of {where}: the server's daemon answered {h.reason!r}")
            _unregister(daemon, req.job, req.server)
            return
        register = local_pb2.RegisterServerRequest(
            job=req.job, name=req.server, model=server.model, params=ack.params, version=h.version
        )
        taken = daemon.serving.add(conn, register, replica=True)
        if taken is not None:
            conn.error(rid, "refused", taken)
            _unregister(daemon, req.job, req.server)
            return
        handoff = daemon.serving.handoff(req.job, req.server)
        daemon.serving.replica_names[(req.job, req.server)] = req.name or req.server
        seed_memory(handoff, h.applied_ids, int(h.version))
        with daemon._lock:
            daemon._roles[conn.conn_id] = conn
        daemon.directory.update(req.job, ack.servers)
        model = local_pb2.ModelReply(
            version=h.version, tensors=h.tensors, payload_bytes=h.payload_bytes, has_payload=True
        )
        registered = local_pb2.RegisterReply(params=ack.params, servers=ack.servers, model=model)
        conn.send(local_pb2.LocalEvent(request_id=rid, registered=registered), buffer.fd)
    finally:
        buffer.release()


def promote(daemon: Any, d: Any) -> bool:
    """A ``PromoteDirective``: the replica of ``d.server`` here becomes the server. False if none."""
    conn = daemon.serving.promote(d.job, d.server)
    if conn is None:
        _LOG.warning("promote directive for server %r of job %r: no replica of it here", d.server, d.job)
        return False
    handoff = daemon.serving.handoff(d.job, d.server)
    daemon.directory.add(
        d.job, ServerLocation(d.server, daemon.host, daemon.data_address, handoff.spec, handoff.version)
    )
    _LOG.warning("replica of server %r of job %r promoted: %s", d.server, d.job, d.reason)
    conn.send(local_pb2.LocalEvent(promoted=local_pb2.Promoted(job=d.job, server=d.server, reason=d.reason)))
    return True


def reroute(daemon: Any, push: PendingPush, host: str, report_first: Callable[[], None]) -> bool:
    """The transfer of ``push`` to ``host`` failed unanswered: re-announce it if its server failed over.

    Only for a server that has a replica (or already failed over from ``host``): wait up to
    :data:`FAILOVER_WAIT` s for the ``JobUpdate`` naming the promoted replica, then report the
    failed transfer (``report_first``) and announce the update again; the scheduler sends it
    to the promoted replica, whose daemon answers from memory an update it already applied
    (replicated from the server) and applies one it lacks — which the surviving model then
    holds exactly once. False (resolve as before) when the server did not fail over.
    """
    loc = daemon.directory.lookup(push.job, push.server)
    if loc is None or not (loc.replicated or loc.failed_over_from == host):
        return False
    deadline = time.monotonic() + FAILOVER_WAIT
    while loc is None or loc.host == host or loc.failed_over_from != host:
        if time.monotonic() >= deadline or daemon._stopping.is_set():
            return False
        time.sleep(0.02)
        loc = daemon.directory.lookup(push.job, push.server)
    report_first()
    if daemon.outgoing.requeue(push.update_id) is None:
        return True  # resolved meanwhile (e.g. the daemon stopping)
    _LOG.warning(
        "%s: server %r failed over from %r to %r; announced again",
        push.update_id,
        push.server,
        host,
        loc.host,
    )
    reason = f"server {push.server!r} failed over; the scheduler is away: {push.update_id} not sent"
    daemon.fallback.announce_or_keep(push, reason)
    return True


def reregister_replicas(daemon: Any) -> None:
    """After a (re)welcome: register this host's replicas again (the scheduler forgot them)."""
    with daemon.serving._lock:
        keys = sorted(daemon.serving.replica_keys)
    for job, server in keys:
        reregister_one(daemon, job, server, 0.0)


def reregister_one(daemon: Any, job: str, server: str, pause: float) -> None:
    """Register the replica of ``server`` again after ``pause`` s, if it is still a replica here.

    A replica whose server is not back yet (``UNKNOWN_JOB``/``UNKNOWN_SERVER``: its daemon has
    not reconnected) is retried with backoff (0.2 s doubling to 2 s).
    """
    if daemon._stopping.wait(pause):
        return
    with daemon.serving._lock:
        still = (job, server) in daemon.serving.replica_keys
        name = daemon.serving.replica_names.get((job, server), server)
    if not still:
        return
    retry = (control_pb2.ERROR_CODE_UNKNOWN_JOB, control_pb2.ERROR_CODE_UNKNOWN_SERVER)

    def on_ack(ack: Any) -> None:
        if ack is not None and not ack.ok and ack.code in retry:
            daemon._tasks.submit(reregister_one, daemon, job, server, min(2.0, max(0.2, 2 * pause)))
        elif ack is None or not ack.ok:
            _LOG.error(
                "re-registering the replica of server %r of job %r failed: %s", server, job, ack and ack.error
            )

    message = control_pb2.RegisterRole(
        job=job, role=control_pb2.ROLE_REPLICA, name=name, replica_of=server, rejoin=True
    )
    daemon._register(message, on_ack)


def send_resync(daemon: Any, d: Any) -> bool:
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
    handoff = daemon.serving.handoff(d.job, d.server)
    if handoff is None:
        _LOG.warning("re-sync of %s: the server is not on this host", where)
        return False
    logs = daemon.replication
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
        src_host=daemon.host,
        applied_ids=handoff.verdicts.applied_ids(4096),
        replica=d.replica,
    )
    try:
        reply = daemon._pool.request(d.replica_address, header, snap.mapping, crc32=snap.checksum())
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


def receive_resync(daemon: Any, frame: Frame) -> Response:
    """A MODEL frame naming a replica of this host (:func:`send_resync`): replace its model.

    The hand-off's version moves to the model's (the next replicated entry is the one after
    it) and the ids the server applied are remembered; the process gets ``Resynced`` (a
    private memfd copy of the payload) before any entry of the new log, which the server's
    daemon forwards only after this ACK.
    """
    h = frame.header
    try:
        key = (h.job, h.server)
        with daemon.serving._lock:
            entry = daemon.serving._roles.get(key) if key in daemon.serving.replica_keys else None
        if entry is None or not isinstance(frame.buffer, PooledBuffer):
            reason = f"no replica of server {h.server!r} of job {h.job!r} on host {daemon.host!r}"
            return Response(error_header(reason, src_host=daemon.host))
        handoff, conn = entry[0], entry[1]
        fd = copy_payload(frame.buffer.fd, int(h.payload_bytes))
        model = local_pb2.ModelReply(
            version=h.version, tensors=h.tensors, payload_bytes=h.payload_bytes, has_payload=True
        )
        event = local_pb2.LocalEvent(resynced=local_pb2.Resynced(job=h.job, server=h.server, model=model))
        try:
            # no entry of an older log is handed over between the version check and the model
            with handoff.replicating:
                if not conn.send(event, fd):
                    reason = f"replica process of server {h.server!r} of job {h.job!r} disconnected"
                    return Response(error_header(reason, src_host=daemon.host))
                handoff.verdicts.advance(int(h.version))
                seed_memory(handoff, h.applied_ids, int(h.version))
        finally:
            os.close(fd)
        _LOG.warning("replica of server %r of job %r re-synced at version %d", h.server, h.job, h.version)
        ack = FrameHeader(kind=_ACK, job=h.job, server=h.server, version=h.version, src_host=daemon.host)
        return Response(ack)
    finally:
        frame.release()
