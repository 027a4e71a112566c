"""The host daemon: wires the local API, the control stream and the data plane (DESIGN §3).

The life of a push (MLfabric §4): a worker process hands its update to the daemon in a memfd;
the daemon checks it against the server's model spec, gives it the id
``"<host>/<incarnation>/<seq>"`` (unique across daemon restarts),
tells the scheduler ``UpdateReady`` and keeps the memfd until the update resolves. On a
``SendDirective`` it sends the bytes to the next hop with ``sendfile`` through the data plane,
retrying a vanished peer a bounded number of times with backoff (the receiver de-duplicates,
so a resend is never applied twice); the ACK carries the server's verdict, which resolves the
push APPLIED (delay, version) or DROPPED (reason) and goes to the scheduler as a
``TransferReport``. A ``DropDirective`` resolves it DROPPED at once.

On the server's host the daemon hands each arriving update (its memfd) to the server process
and answers the sender with the process's verdict; ``get`` is answered from the model the
server process last published. With a :class:`TransferReportLog` every transfer report
also goes to a JSON-lines file (``--report-file``). If the scheduler stream breaks, pushes
still waiting for a directive keep their place (:mod:`mlfabric.daemon.roles.worker.fallback`: announced
again when it is back, sent directly to their servers if it stays away longer than
``fallback_after``), and the daemon reconnects and re-registers.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlfabric.daemon.channels.budget import BudgetExceeded, ByteBudget, Ticker
from mlfabric.daemon.channels.control import ControlStream, control_channel, local_error_code
from mlfabric.daemon.channels.frames import (
    Frame,
    FrameError,
    FrameHeader,
    FrameLimits,
    check_header,
)
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.localapi import LocalApiServer, LocalConnection
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.registration import SchedulerSession
from mlfabric.daemon.reports import TransferReportLog
from mlfabric.daemon.roles.aggregator.role import AggregatorRole
from mlfabric.daemon.roles.allreduce.role import AllreduceRole
from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.directory import Directory, ServerLocation, spec_from_pb
from mlfabric.daemon.roles.replica.log import ReplicationLogs
from mlfabric.daemon.roles.replica.role import receive_resync, register_replica, reroute
from mlfabric.daemon.roles.server.serving import ServerRoles
from mlfabric.daemon.roles.worker.fallback import Fallback, update_ready
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes, PendingPush, new_incarnation
from mlfabric.daemon.roles.worker.sender import PushSender
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.wire.memfd import MemfdPool
from mlfabric.wire.tensors import check_update, layouts_from_pb
from mlfabric.wire.version import __version__

__all__ = ["Daemon"]

_LOG = logging.getLogger("mlfabric.daemon")
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_MODEL = dataplane_pb2.FRAME_KIND_MODEL


class Daemon(SchedulerSession):
    """One host's daemon. Construct, :meth:`start`, and :meth:`stop` (no I/O before ``start``).

    Its side of the scheduler session (registrations, directives, re-registration) is
    :class:`~mlfabric.daemon.registration.SchedulerSession`.

    Parameters
    ----------
    config : DaemonConfig
        Addresses and limits.
    clock : callable
        Monotonic seconds (``ready_at`` of updates).
    channel_factory : callable, optional
        ``channel_factory(target) -> grpc.Channel`` for the control stream (tests).
    report_log : TransferReportLog, optional
        Also append every transfer report sent to the scheduler here (opened by
        :meth:`start`, closed by :meth:`stop`).

    Examples
    --------
    >>> daemon = Daemon(DaemonConfig(host="w0", scheduler="127.0.0.1:7077", socket_path="/tmp/w0.sock"))
    >>> daemon.start()          # doctest: +SKIP
    >>> daemon.data_address     # doctest: +SKIP
    '127.0.0.1:40123'
    >>> daemon.stop()           # doctest: +SKIP
    """

    def __init__(
        self,
        config: DaemonConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        channel_factory: Callable[[str], Any] | None = None,
        report_log: TransferReportLog | None = None,
    ) -> None:
        self.config = config
        self._report_log = report_log
        self.host = config.host
        self._clock = clock
        self._egress = TokenBucket(config.egress_rate)
        self._ingress = TokenBucket(config.ingress_rate)
        limits = FrameLimits(max_payload_bytes=config.max_payload_bytes)
        self._limits = limits
        self.serving = ServerRoles(config.host, limits, config.verdict_timeout)
        self.receive_budget = ByteBudget(config.max_inflight_bytes, "receive")
        self.push_budget = ByteBudget(config.max_inflight_bytes, "push")
        self.receive_buffers = MemfdPool(
            min(config.receive_pool_bytes, config.max_inflight_bytes),
            name="mlfabric-dataplane",
            budget=self.receive_budget,
            budget_timeout=config.io_timeout,
            max_idle_seconds=config.pool_idle_seconds,
        )
        self._listener = DataPlaneListener(
            config.data_listen,
            self._on_frame,
            limits,
            self._ingress,
            self._egress,
            alloc=self.receive_buffers.allocate,
            io_timeout=config.io_timeout,
            idle_timeout=config.idle_timeout,
            header_timeout=config.header_timeout,
            max_connections=config.max_connections,
            auth=config.data_auth,
        )
        self._pool = PeerPool(
            limits,
            self._egress,
            self._ingress,
            connect_timeout=config.connect_timeout,
            io_timeout=config.io_timeout,
            max_idle_seconds=None if config.idle_timeout is None else config.idle_timeout / 2,
            auth=config.data_auth,
            send_attempts=config.send_attempts,
            retry_backoff=config.retry_backoff,
        )
        self._local = LocalApiServer(
            config.socket_path,
            self._on_request,
            self._on_close,
            idle_timeout=config.idle_timeout,
            message_timeout=config.header_timeout,
            max_connections=config.max_connections,
            access=config.local_access,
        )
        self._control = ControlStream(
            config.scheduler,
            lambda: control_pb2.Hello(
                host=self.host,
                data_address=self.data_address,
                version=__version__,
                can_aggregate=config.aggregator,
            ),
            self._on_directive,
            self._on_connected,
            self._on_disconnected,
            channel_factory=channel_factory or control_channel(config.tls, config.tls_server_name),
        )
        self._tasks = ThreadPoolExecutor(max_workers=32, thread_name_prefix="daemon-task")
        self._lock = threading.Lock()
        self._acks: dict[int, Callable[[Any], None]] = {}
        self._ack_ids = itertools.count(1)
        self._roles: dict[int, LocalConnection] = {}
        #: workers (by connection) not registered with the scheduler: (for good, why)
        self._unregistered: dict[int, tuple[bool, str]] = {}
        self._stopping = threading.Event()
        self.directory = Directory()
        self.outgoing = OutgoingPushes(config.host, new_incarnation())
        self.sender = PushSender(
            config.host,
            self._pool,
            self.outgoing,
            self._send_report,
        )
        self.sender.on_finish = lambda push: self.push_budget.release(push.payload_bytes)
        #: replication logs of this host's servers that have a replica (docs/replication.md)
        self.replication = ReplicationLogs(config.host, self._pool.request, self._control.send)
        self.serving.replication = self.replication
        self.sender.reroute = lambda push, host, first: reroute(self, push, host, first)
        self.fallback = Fallback(
            config.fallback_after,
            self.outgoing,
            self.directory,
            lambda p: self._control.send(control_pb2.DaemonMessage(update_ready=update_ready(p))),
            lambda p, send: self._tasks.submit(self.sender.transfer, p, send),
            self.sender.finish,
            clock,
        )
        #: all-reduces of this host's processes (docs/allreduce.md)
        self.allreduce = AllreduceRole(config.host, self._control.send, self._pool.request, clock)
        self._ticker = Ticker(0.1, [self.fallback.tick, self.receive_buffers.trim, self.allreduce.tick])
        self.aggregator = AggregatorRole(
            config.host,
            self.receive_buffers.allocate,
            lambda ready: self._control.send(control_pb2.DaemonMessage(update_ready=ready)),
            lambda failed: self._control.send(control_pb2.DaemonMessage(aggregate_failed=failed)),
            self._send_report,
            self._pool.deliver,
            clock=clock,
            enabled=config.aggregator,
        )
        self.serving.aggregation.alloc = self.receive_buffers.allocate
        self.serving.aggregation.round_timeout = config.round_timeout
        self.data_address: str = ""

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        """Listen on the data plane and the local socket, connect to the scheduler.

        Raises
        ------
        TimeoutError
            The scheduler did not welcome the daemon within ``timeout`` seconds (everything
            started is stopped again).
        """
        if self._report_log is not None:
            self._report_log.start()
        self.data_address = self._listener.start()
        self.aggregator.start()
        threading.Thread(target=self._push_deadlines, name="push-deadline", daemon=True).start()
        self._local.start()
        self._control.start()
        self._ticker.start()
        deadline = time.monotonic() + timeout
        while not self._control.connected.wait(0.05):
            if self._control.refused.is_set() or time.monotonic() > deadline:
                break
        if not self._control.connected.is_set():
            error = self._control.last_error or "no answer"
            self.stop()
            raise TimeoutError(
                f"scheduler at {self.config.scheduler} did not welcome host {self.host!r}: {error}"
            )

    def stop(self) -> None:
        """Stop everything; pushes not yet resolved resolve DROPPED."""
        self._stopping.set()
        self._control.stop()
        self._ticker.stop()
        self._local.stop()
        self._listener.stop()
        self.aggregator.stop()
        self.allreduce.stop()
        self._pool.stop(f"daemon of host {self.host!r} is stopping")  # cut the transfers in flight
        self._tasks.shutdown(wait=True, cancel_futures=True)
        for push in self.outgoing.take_all():
            self.sender.finish(push, Verdict.dropped(f"daemon of host {self.host!r} shut down"))
        self.serving.close_all(f"daemon of host {self.host!r} shut down")
        self.replication.close_all()
        self._pool.close()
        self.receive_buffers.close()
        if self._report_log is not None:
            self._report_log.stop()

    def _push_deadlines(self) -> None:
        """Resolve DROPPED every push still waiting for a directive past ``push_timeout``."""
        timeout = self.config.push_timeout
        while not self._stopping.wait(min(1.0, timeout / 4)):
            for push in self.outgoing.take_expired(self._clock(), timeout):
                reason = (
                    f"push deadline: {push.update_id} got no directive from the scheduler at "
                    f"{self.config.scheduler} within {timeout:g} s"
                )
                self.sender.finish(push, Verdict.dropped(reason))
                resolved = control_pb2.UpdateResolved(
                    update_id=push.update_id, outcome=control_pb2.OUTCOME_DROPPED, reason=reason
                )
                self._control.send(control_pb2.DaemonMessage(update_resolved=resolved))

    def _send_report(self, report: Any) -> None:
        """Send a ``TransferReport`` to the scheduler and append it to the report log, if any."""
        self._control.send(control_pb2.DaemonMessage(transfer_report=report))
        if self._report_log is not None:
            try:
                self._report_log.write(report)
            except (OSError, RuntimeError) as exc:  # full disk, or a report racing stop()
                _LOG.error(
                    "transfer report %s not written to %s: %s", report.update_id, self._report_log.path, exc
                )

    # ------------------------------------------------------------------ data plane

    def _on_frame(self, frame: Frame) -> Response:
        """The data-plane handler: a member for an aggregate here goes to the aggregator role."""
        h = frame.header
        if h.kind == _UPDATE and h.HasField("allreduce"):
            return self.allreduce.on_frame(frame)
        if h.kind == _UPDATE and h.aggregate_id and h.update_id != h.aggregate_id:
            return self.aggregator.on_frame(frame)
        if h.kind == _MODEL and h.replica:  # a replica here is re-synced (docs/replication.md)
            return receive_resync(self, frame)
        return self.serving.on_frame(frame)

    # ------------------------------------------------------------------ local API

    def _on_request(self, conn: LocalConnection, request: Any, fd: int | None) -> None:
        kind = request.WhichOneof("kind")
        handler = {
            "register_worker": self._register_worker,
            "register_server": self._register_server,
            "push": self._push,
            "get": self._get,
            "verdict": self.serving.verdict,
            "publish": self.serving.publish,
            "register_replica": lambda c, r, f: register_replica(self, c, r, f),
            "allreduce": self.allreduce.on_request,
        }.get(kind or "")
        if handler is None:
            conn.error(request.request_id, "bad_request", f"empty or unknown local request kind {kind!r}")
        else:
            fd = handler(conn, request, fd)
        if fd is not None:  # a handler that keeps the fd returns None
            os.close(fd)

    def _on_close(self, conn: LocalConnection) -> None:
        self.allreduce.connection_closed(conn)
        with self._lock:
            self._roles.pop(conn.conn_id, None)
            self._unregistered.pop(conn.conn_id, None)
        replica = conn.role == "server" and self.serving.is_replica(conn)
        if conn.role == "server":
            self.serving.remove(conn)
        if conn.role:
            role = control_pb2.ROLE_SERVER if conn.role == "server" else control_pb2.ROLE_WORKER
            role = control_pb2.ROLE_REPLICA if replica else role
            self._control.send(
                control_pb2.DaemonMessage(
                    unregister_role=control_pb2.UnregisterRole(job=conn.job, role=role, name=conn.name)
                )
            )

    def _register_worker(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        req, rid = request.register_worker, request.request_id
        if conn.role:
            conn.error(
                rid, "bad_request", f"this connection is already registered as {conn.role} {conn.name!r}"
            )
            return fd
        deadline = self._clock() + max(0.0, req.wait_seconds)

        def on_ack(ack: Any) -> None:
            if ack is not None and ack.ok:
                conn.role, conn.job, conn.name = "worker", req.job, req.name
                with self._lock:
                    self._roles[conn.conn_id] = conn
                self.directory.update(req.job, ack.servers)
                self._tasks.submit(reply_when_servers, ack.params)
            elif (
                ack is not None
                and ack.code == control_pb2.ERROR_CODE_UNKNOWN_JOB
                and self._clock() < deadline
                and not self._stopping.is_set()
                and not conn.closed  # its process went away: stop asking for it
            ):  # the job has no server yet: wait for one
                self._tasks.submit(retry)
            else:
                error = (
                    ack.error if ack is not None else f"scheduler at {self.config.scheduler} is not connected"
                )
                conn.error(rid, "unavailable" if ack is None else local_error_code(ack.code), error)

        def retry() -> None:
            self._stopping.wait(0.2)
            self._register(
                control_pb2.RegisterRole(job=req.job, name=req.name, role=control_pb2.ROLE_WORKER), on_ack
            )

        def reply_when_servers(params: Any) -> None:
            while not self.directory.wait_for_servers(req.job, min(0.5, deadline - self._clock())):
                if self._stopping.is_set() or self._clock() >= deadline or conn.closed:
                    break
            if not self.directory.servers(req.job):
                conn.error(
                    rid,
                    "unknown_job",
                    f"unknown job {req.job!r}: no servers registered (waited {req.wait_seconds} s)",
                )
                return
            servers = [self._server_info(req.job, name) for name in self.directory.servers(req.job)]
            conn.send(
                local_pb2.LocalEvent(
                    request_id=rid, registered=local_pb2.RegisterReply(params=params, servers=servers)
                )
            )

        self._register(
            control_pb2.RegisterRole(job=req.job, name=req.name, role=control_pb2.ROLE_WORKER), on_ack
        )
        return fd

    def _server_info(self, job: str, name: str) -> Any:
        loc = self.directory.lookup(job, name)
        assert loc is not None
        return control_pb2.ServerInfo(
            name=loc.name,
            host=loc.host,
            data_address=loc.data_address,
            version=loc.version,
            model=[control_pb2.TensorSpec(name=n, dtype=d, shape=list(s)) for n, (d, s) in loc.spec.items()],
        )

    def _register_server(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        req, rid = request.register_server, request.request_id
        if conn.role:
            conn.error(
                rid, "bad_request", f"this connection is already registered as {conn.role} {conn.name!r}"
            )
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
            if ack is None or not ack.ok:
                error = (
                    ack.error if ack is not None else f"scheduler at {self.config.scheduler} is not connected"
                )
                conn.error(rid, "unavailable" if ack is None else local_error_code(ack.code), error)
                return
            taken = self.serving.add(conn, req)
            if taken is not None:
                conn.error(rid, "refused", taken)
                return
            with self._lock:
                self._roles[conn.conn_id] = conn
            spec = spec_from_pb(req.model)
            self.directory.update(req.job, ack.servers)
            self.directory.add(
                req.job, ServerLocation(req.name, self.host, self.data_address, spec, req.version)
            )
            reply = local_pb2.RegisterReply(params=req.params, servers=ack.servers)
            conn.send(local_pb2.LocalEvent(request_id=rid, registered=reply))

        self._register(message, on_ack)
        return fd

    def _push(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        req, rid = request.push, request.request_id
        if conn.role != "worker":
            conn.error(rid, "bad_request", "push before register_as_worker on this connection")
            return fd
        with self._lock:
            lost, why = self._unregistered.get(conn.conn_id, (None, ""))
        where = (
            f"worker {conn.name!r} of job {conn.job!r} is {{}} registered with the scheduler at "
            f"{self.config.scheduler}: {why}"
        )
        if lost:
            conn.error(rid, "role_lost", where.format("no longer") + " (register again)")
            return fd
        if lost is not None and not self.fallback.enabled:  # re-registering: the scheduler would not know it
            result = local_pb2.PushResult(outcome=control_pb2.OUTCOME_DROPPED, reason=where.format("not"))
            conn.send(local_pb2.LocalEvent(request_id=rid, push_result=result))
            return fd
        loc = self.directory.lookup(conn.job, req.server)
        if loc is None:
            known = self.directory.servers(conn.job)
            conn.error(
                rid, "unknown_server", f"unknown server {req.server!r} in job {conn.job!r} (servers: {known})"
            )
            return fd
        if fd is None:
            conn.error(rid, "bad_request", "push without a payload memfd")
            return fd
        layouts = layouts_from_pb(req.tensors)
        problem = check_update(loc.spec, layouts, f"server {req.server!r} of job {conn.job!r}")
        header = FrameHeader(kind=_UPDATE, payload_bytes=req.payload_bytes, tensors=req.tensors)
        try:
            check_header(header, self._limits)
        except FrameError as exc:
            problem = problem or f"bad tensor layout: {exc}"
        if problem is None and os.fstat(fd).st_size < req.payload_bytes:
            problem = f"payload memfd holds {os.fstat(fd).st_size} bytes, push says {req.payload_bytes}"
        if problem is not None:
            conn.error(rid, "bad_tensor", problem)
            return fd
        try:  # back-pressure: wait for push budget
            self.push_budget.acquire(req.payload_bytes, self.config.io_timeout, self._stopping)
        except MemoryError as exc:  # BudgetExceeded or BudgetTimeout, named in the message
            conn.error(rid, "too_large" if isinstance(exc, BudgetExceeded) else "unavailable", str(exc))
            return fd
        push = PendingPush(
            update_id=self.outgoing.new_update_id(),
            job=conn.job,
            server=req.server,
            worker=conn.name,
            fd=fd,
            layouts=layouts,
            payload_bytes=req.payload_bytes,
            norm=req.norm,
            base_version=req.base_version,
            ready_at=self._clock(),
            request_id=rid,
            owner=conn,
            crc32=req.payload_crc32 if req.has_crc32 else None,
        )
        self.outgoing.add(push)
        conn.send(
            local_pb2.LocalEvent(
                request_id=rid, push_accepted=local_pb2.PushAccepted(update_id=push.update_id)
            )
        )
        # re-registering: kept, announced once the worker is registered (or sent directly)
        reason = f"scheduler at {self.config.scheduler} not connected; {push.update_id} not scheduled"
        self.fallback.announce_or_keep(push, reason, announce=lost is None)
        return None

    def _get(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        server, rid = request.get.server, request.request_id
        job = conn.job
        loc = self.directory.lookup(job, server) if conn.role else None
        if loc is None:
            known = self.directory.servers(job)
            conn.error(rid, "unknown_server", f"unknown server {server!r} in job {job!r} (servers: {known})")
            return fd
        if self.serving.hosts(job, server):
            self.serving.send_model(conn, rid, job, server)
        else:
            self._tasks.submit(self.sender.remote_model, conn, rid, job, server, loc.data_address)
        return fd
