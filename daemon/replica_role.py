"""The replica role on a daemon: registration with the model, promotion (docs/replication.md).

``mlfabric.register_as_replica(job, server)`` sends ``RegisterReplicaRequest``; the daemon
registers ``ROLE_REPLICA`` with the scheduler (which checks the job, the server, the model
spec and that the server has no replica yet), fetches the server's model from the server's
daemon with a GET naming the replica — the server's daemon starts its replication log at the
version it answers — and hands the model to the process in the ``RegisterReply`` (memfd).
From then on the replica is a server role of this host flagged as a replica
(:class:`~mlfabric.daemon.serving.ServerRoles`): it applies replicated entries only, and
``get`` on this host is not answered from it. A ``PromoteDirective`` makes it the server:
the flag goes, the process learns it (``Promoted``) and keeps serving with the same loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.control import local_error_code
from mlfabric.daemon.fallback import update_ready
from mlfabric.daemon.replication import seed_memory
from mlfabric.daemon.roles import PendingPush, ServerLocation, Verdict
from mlfabric.daemon.serving import MemfdBuffer
from mlfabric.daemon.transport import PeerUnavailable
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2

__all__ = ["FAILOVER_WAIT", "promote", "register_replica", "reregister_replicas", "reroute"]

#: seconds an update whose transfer to a replicated server failed waits for the failover
FAILOVER_WAIT = 3.0

_LOG = logging.getLogger("mlfabric.daemon")
_GET = dataplane_pb2.FRAME_KIND_GET
_MODEL = dataplane_pb2.FRAME_KIND_MODEL


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
        reply = daemon.sender.request(server.data_address, header, alloc=MemfdBuffer.allocate)
    except PeerUnavailable as exc:
        conn.error(rid, "unavailable", f"replica of {where}: model fetch from {server.host!r} failed: {exc}")
        _unregister(daemon, req.job, req.server)
        return
    buffer = reply.buffer if isinstance(reply.buffer, MemfdBuffer) else MemfdBuffer.allocate(0)
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
    sent = daemon._control.send(control_pb2.DaemonMessage(update_ready=update_ready(push)))
    if not sent and not daemon.fallback.keep(push):
        taken = daemon.outgoing.take(push.update_id)
        if taken is not None:
            reason = f"server {push.server!r} failed over; the scheduler is away: {push.update_id} not sent"
            daemon.sender.finish(taken, Verdict.dropped(reason))
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

    message = control_pb2.RegisterRole(job=job, role=control_pb2.ROLE_REPLICA, name=name, replica_of=server)
    daemon._register(message, on_ack)
