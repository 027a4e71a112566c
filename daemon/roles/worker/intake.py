"""The worker role: a worker process's registration, its pushes and gets (DESIGN §3, paper Table 1).

The life of a push on its worker's daemon (MLfabric §4): the process hands its update in a
memfd (``push``); :class:`WorkerRole` checks it against the server's model spec, waits for
push budget, gives it its id ``"<host>/<incarnation>/<seq>"`` and keeps the memfd
(:class:`~mlfabric.daemon.roles.worker.pushes.OutgoingPushes`) until it resolves; tells the
scheduler ``UpdateReady`` (or keeps it for the fallback while the scheduler is away,
:mod:`~mlfabric.daemon.roles.worker.fallback`); on a ``SendDirective`` sends it
(:class:`~mlfabric.daemon.roles.worker.sender.PushSender`); a ``DropDirective`` or the push
deadline resolves it DROPPED, a ``ResolveDirective`` with the aggregate's verdict. ``get`` is
answered from the model a server of this host published, or fetched from the server's daemon.

When the scheduler session breaks the waiting pushes keep their place (or, without a fallback,
resolve DROPPED); after a new ``Welcome`` each worker registers again, with backoff while its
job has no server yet, and its kept pushes are announced once it is registered.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.channels.budget import BudgetExceeded, ByteBudget
from mlfabric.daemon.channels.frames import FrameError, FrameHeader, FrameLimits, check_header
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.daemon.roles.base import (
    Role,
    RoleContext,
    Routes,
    Verdict,
    already_registered,
    refused,
)
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.registrar import OnAck, Registrar
from mlfabric.daemon.roles.relay.role import ModelRelays
from mlfabric.daemon.roles.worker.fallback import Fallback, update_ready
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes, PendingPush, new_incarnation
from mlfabric.daemon.roles.worker.sender import PushSender
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.wire.tensors import Layout, check_update, layouts_from_pb

#: seconds a registration waits for the name's holder to go: another process of this host (a
#: process restarted at once may register before the daemon saw the old one's socket close), or
#: a worker on another host (the scheduler refuses with DUPLICATE_WORKER until that host's
#: daemon's unregistration arrives)
DUPLICATE_GRACE = 2.0

__all__ = ["WorkerRole"]

_LOG = logging.getLogger("mlfabric.daemon")
_UNKNOWN_JOB = control_pb2.ERROR_CODE_UNKNOWN_JOB
_DUPLICATE = control_pb2.ERROR_CODE_DUPLICATE_WORKER


class WorkerRole(Role):
    """The workers of this host's processes, and the pushes they made (thread-safe).

    Parameters
    ----------
    context : RoleContext
        Host, scheduler session, task pool, stopping flag, clock.
    registrar : Registrar
        Registers the workers with the scheduler.
    directory : Directory
        Where every job's servers are.
    peers : PeerPool
        The data plane's way out (transfers, model fetches).
    models : ModelRelays
        Answers ``get`` (from a server here, the model cache, a relay or the server's daemon).
    budget : ByteBudget
        The push budget: bytes of pushes held at once.
    report : callable
        ``report(TransferReport)`` to the scheduler (and the report log).
    limits : FrameLimits
        What a pushed update may be.
    fallback_after : float or None
        Seconds without a scheduler before pushes are sent directly (None: they resolve DROPPED).
    push_timeout : float
        The push deadline: seconds a push may wait for a directive.
    budget_timeout : float or None
        Seconds a push waits for push budget.
    """

    #: the pushes held until they resolve, how they are sent, the fallback while the scheduler is away
    outgoing: OutgoingPushes
    sender: PushSender
    fallback: Fallback

    def __init__(
        self,
        context: RoleContext,
        registrar: Registrar,
        directory: Directory,
        peers: PeerPool,
        models: ModelRelays,
        budget: ByteBudget,
        report: Callable[[Any], Any],
        *,
        limits: FrameLimits,
        fallback_after: float | None,
        push_timeout: float,
        budget_timeout: float | None,
        on_push: Callable[[list[Layout], int], None] | None = None,
    ) -> None:
        self._ctx = context
        self._on_push = on_push
        self._registrar = registrar
        self._directory = directory
        self._peers = peers
        self._models = models
        self._budget = budget
        self._limits = limits
        self._push_timeout = push_timeout
        self._budget_timeout = budget_timeout
        self._lock = threading.Lock()
        #: registered workers by connection id
        self._workers: dict[int, LocalConnection] = {}
        #: workers (by connection) not registered with the scheduler: (for good, why)
        self._unregistered: dict[int, tuple[bool, str]] = {}
        self.outgoing = OutgoingPushes(context.host, new_incarnation())
        self.sender = PushSender(
            context,
            peers,
            self.outgoing,
            report,
            directory,
            reannounce=lambda push, reason: self.fallback.announce_or_keep(push, reason),
            on_finish=lambda push: budget.release(push.payload_bytes),
            on_stale_hold=self._stale_hold,
        )
        self.fallback = Fallback(
            fallback_after,
            self.outgoing,
            directory,
            lambda push: context.send(control_pb2.DaemonMessage(update_ready=update_ready(push))),
            lambda push, send: context.submit(self.sender.transfer, push, send),
            self.sender.finish,
            context.clock,
        )
        self._deadlines: threading.Thread | None = None

    def routes(self) -> Routes:
        return Routes(
            requests={"register_worker": self.register, "push": self.push, "get": self.get},
            directives={"send": self.on_send, "drop": self.on_drop, "resolve": self.sender.resolve},
        )

    @property
    def workers(self) -> int:
        """Worker processes registered here."""
        with self._lock:
            return len(self._workers)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the push deadline's thread."""
        self._deadlines = threading.Thread(target=self._push_deadlines, name="push-deadline", daemon=True)
        self._deadlines.start()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the transfers under way to end (shutdown); True if they did.

        Their pushes then resolve with the server's verdict (APPLIED, DROPPED) rather than
        UNKNOWN when the daemon cuts them.
        """
        deadline = self._ctx.clock() + timeout
        while self.outgoing.sending():
            if self._ctx.clock() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> None:
        """Resolve every push still held (after the transfers in flight were cut), while the
        processes that pushed them are still connected: DROPPED, or UNKNOWN if summed at an
        aggregator."""
        self.sender.shut_down(self.outgoing.take_all(), f"daemon of host {self._ctx.host!r} shut down")

    def tick(self) -> None:
        self.fallback.tick()
        if self.fallback.active:
            self._let_go_held()

    def _let_go_held(self) -> None:
        """Falling back, no scheduler session will resolve a held push: let each go now.

        As a new session would (``unhold``): UNKNOWN if its aggregator summed it (the
        aggregate may have left before the scheduler went away), else sent directly to its
        server like the other pushes while the scheduler is away.
        """
        for update_id in self.outgoing.held_ids():
            if self.sender.unhold_one(update_id) is None:
                continue  # summed (resolved UNKNOWN), or no longer held
            push = self.outgoing.waiting(update_id)
            if push is not None:
                self.fallback.keep(push)  # falling back: sent directly at once

    def _push_deadlines(self) -> None:
        """Apply the push deadline (:meth:`expire_pushes`) every ``push_timeout / 4`` s (1 s at most)."""
        while not self._ctx.stopping.wait(min(1.0, self._push_timeout / 4)):
            self.expire_pushes()

    def expire_pushes(self) -> int:
        """Resolve every push waiting for a directive ``push_timeout`` s or more; how many.

        READY (no send directive came): DROPPED. HELD (its aggregate's verdict, or a new send
        directive, never came): UNKNOWN if it may have been summed, else DROPPED
        (:meth:`PushSender.expired`). The scheduler is told either way (``UpdateResolved``).
        """
        timeout = self._push_timeout
        expired = self.outgoing.take_expired(self._ctx.clock(), timeout)
        for push in expired:
            verdict = self.sender.expired(push, timeout, self._ctx.scheduler)
            _LOG.warning("%s", verdict.reason)
            self.sender.finish(push, verdict)
            resolved = control_pb2.UpdateResolved(
                update_id=push.update_id, outcome=verdict.outcome, reason=verdict.reason
            )
            self._ctx.send(control_pb2.DaemonMessage(update_resolved=resolved))
        return len(expired)

    # ------------------------------------------------------------------ the scheduler session

    def scheduler_connected(self) -> None:
        """Back to scheduled sends; every worker is unregistered until it registered again."""
        self.sender.new_session()
        self.fallback.connected()
        with self._lock:
            for conn_id in self._workers:
                self._unregistered[conn_id] = (False, "re-registering after the scheduler restarted")

    def register_again(self) -> None:
        """Register every worker again (retried while its job has no server, as long as it is here).

        Until then its pushes are kept (announced once it is registered, or sent directly after
        ``fallback_after``), or without a fallback resolve DROPPED naming that. Refused for
        another reason, its role is gone for good: its pushes get an error.
        """
        with self._lock:
            workers = list(self._workers.values())
        for conn in workers:
            message = control_pb2.RegisterRole(job=conn.job, name=conn.name, role=control_pb2.ROLE_WORKER)
            self._registrar.register_until(
                message,
                self._registered_again(conn),
                retry=(_UNKNOWN_JOB,),
                wanted=functools.partial(self._is_worker, conn),
            )

    def _is_worker(self, conn: LocalConnection) -> bool:
        with self._lock:
            return self._workers.get(conn.conn_id) is conn

    def _registered_again(self, conn: LocalConnection) -> OnAck:
        conn_id, job, name = conn.conn_id, conn.job, conn.name

        def on_ack(ack: Any) -> None:
            with self._lock:
                if self._workers.get(conn_id) is not conn:
                    return  # the worker's process went away meanwhile
                if ack is not None and ack.code == _UNKNOWN_JOB:
                    why = f"refused ({ack.error}); retrying until the job's server is back"
                    self._unregistered[conn_id] = (False, why)
                elif ack is not None and ack.ok:
                    self._unregistered.pop(conn_id, None)
                elif ack is not None:
                    self._unregistered[conn_id] = (True, ack.error)
            if ack is not None and ack.code == _UNKNOWN_JOB:
                return  # registered again later
            if self._registrar.log_answer(job, name, ack):
                for ready in self.sender.unhold(job, name):  # held for an aggregate it never saw
                    self._ctx.send(control_pb2.DaemonMessage(update_ready=ready))
                self.fallback.announce_worker(job, name)  # kept while it was away

        return on_ack

    def _stale_hold(self, push: PendingPush) -> None:
        """A push held under a session that ended: announced anew if its worker registered again.

        Its transfer to an aggregator ended after its worker's registration with the new
        session made the held pushes ready (``unhold``): no session would ever resolve it.
        While the worker is still re-registering it stays held; that registration lets it go.
        """
        with self._lock:
            registered = any(
                (c.job, c.name) == (push.job, push.worker) and c.conn_id not in self._unregistered
                for c in self._workers.values()
            )
        if not registered:
            return
        ready = self.sender.unhold_one(push.update_id)
        if ready is not None:
            _LOG.info("%s: held under an ended scheduler session; announced again", push.update_id)
            self._ctx.send(control_pb2.DaemonMessage(update_ready=ready))

    def scheduler_lost(self, reason: str) -> None:
        """Waiting pushes keep their place (sent directly if it stays away), or resolve DROPPED."""
        if self.fallback.enabled:
            self.fallback.lost()
            return
        for push in self.outgoing.take_waiting():
            self.sender.finish(
                push, Verdict.dropped(f"scheduler connection lost before {push.update_id} was sent: {reason}")
            )

    def connection_closed(self, conn: LocalConnection) -> None:
        """A worker's process went away: forget it, tell the scheduler (its pushes still resolve)."""
        with self._lock:
            self._workers.pop(conn.conn_id, None)
            self._unregistered.pop(conn.conn_id, None)
        if conn.role == "worker":
            message = control_pb2.UnregisterRole(job=conn.job, role=control_pb2.ROLE_WORKER, name=conn.name)
            self._ctx.send(control_pb2.DaemonMessage(unregister_role=message))

    # ------------------------------------------------------------------ directives

    def on_send(self, send: Any) -> None:
        """A ``SendDirective`` for a push held here: send it (on the task pool)."""
        push = self.outgoing.start_sending(send.update_id, session=self.sender.session)
        if push is None:
            _LOG.warning("send directive for unknown or busy update %r", send.update_id)
        else:
            self._ctx.submit(self.sender.transfer, push, send)

    def on_drop(self, drop: Any) -> None:
        """A ``DropDirective``: the push resolves DROPPED with the scheduler's reason."""
        dropped = self.outgoing.take(drop.update_id)
        if dropped is not None:
            self.sender.finish(dropped, Verdict.dropped(drop.reason or "dropped by the scheduler"))

    # ------------------------------------------------------------------ local requests

    def register(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """``RegisterWorkerRequest``: register with the scheduler, waiting for the job's servers."""
        req, rid = request.register_worker, request.request_id
        if already_registered(conn, rid):
            return fd
        if self._holder(conn, req.job, req.name) is not None:
            # another process of this host holds the name (its leaving would unregister it): a
            # process restarted at once may come before the daemon saw the old one's socket close
            self._ctx.submit(self._register_when_free, conn, request)
            return fd
        self._register(conn, request)
        return fd

    def _holder(self, conn: LocalConnection, job: str, name: str) -> LocalConnection | None:
        """Another live connection registered as worker ``name`` of ``job`` here, if any."""
        with self._lock:
            return next(
                (
                    c
                    for c in self._workers.values()
                    if c is not conn and not c.closed and (c.job, c.name) == (job, name)
                ),
                None,
            )

    def _register_when_free(self, conn: LocalConnection, request: Any) -> None:
        req = request.register_worker
        until = self._ctx.clock() + DUPLICATE_GRACE
        while self._holder(conn, req.job, req.name) is not None:
            if self._ctx.clock() >= until or self._ctx.stopping.is_set() or conn.closed:
                why = (
                    f"worker {req.name!r} of job {req.job!r} is already registered on this host by "
                    "another process; worker names are unique within a job"
                )
                conn.error(request.request_id, "duplicate_worker", why)
                return
            self._ctx.stopping.wait(0.02)
        self._register(conn, request)

    def _register(self, conn: LocalConnection, request: Any) -> None:
        req, rid = request.register_worker, request.request_id
        deadline = self._ctx.clock() + max(0.0, req.wait_seconds)
        moving = self._ctx.clock() + DUPLICATE_GRACE
        message = control_pb2.RegisterRole(job=req.job, name=req.name, role=control_pb2.ROLE_WORKER)

        def waits(ack: Any) -> bool:
            """A refusal that may lift: no server yet, or the name's last holder on another
            host gone a moment ago (its daemon's unregistration still on its way)."""
            if ack is None or self._ctx.stopping.is_set() or conn.closed:  # its process went away
                return False
            now = self._ctx.clock()
            return (ack.code == _UNKNOWN_JOB and now < deadline) or (ack.code == _DUPLICATE and now < moving)

        def on_ack(ack: Any) -> None:
            if ack is not None and ack.ok:
                conn.role, conn.job, conn.name = "worker", req.job, req.name
                with self._lock:
                    self._workers[conn.conn_id] = conn
                self._directory.update(req.job, ack.servers)
                self._ctx.submit(reply_when_servers, ack.params)
            elif waits(ack):
                self._ctx.submit(retry)
            else:
                refused(conn, rid, ack, self._ctx)

        def retry() -> None:
            self._ctx.stopping.wait(0.2)
            self._registrar.register(message, on_ack)

        def reply_when_servers(params: Any) -> None:
            job = req.job
            while not self._directory.wait_for_servers(job, min(0.5, deadline - self._ctx.clock())):
                if self._ctx.stopping.is_set() or self._ctx.clock() >= deadline or conn.closed:
                    break
            if not self._directory.servers(job):
                why = f"unknown job {job!r}: no servers registered (waited {req.wait_seconds} s)"
                conn.error(rid, "unknown_job", why)
                return
            infos = (self._directory.info(job, name) for name in self._directory.servers(job))
            servers = [info for info in infos if info is not None]  # one may have left meanwhile
            reply = local_pb2.RegisterReply(params=params, servers=servers)
            conn.send(local_pb2.LocalEvent(request_id=rid, registered=reply))

        self._registrar.register(message, on_ack)

    def push(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """``PushRequest``: check the update, keep its memfd, announce it. Returns an fd to close."""
        req, rid = request.push, request.request_id
        if conn.role != "worker":
            conn.error(rid, "bad_request", "push before register_as_worker on this connection")
            return fd
        if self._ctx.stopping.is_set():
            reason = f"daemon of host {self._ctx.host!r} is shutting down; not accepted"
            result = local_pb2.PushResult(outcome=control_pb2.OUTCOME_DROPPED, reason=reason)
            conn.send(local_pb2.LocalEvent(request_id=rid, push_result=result))
            return fd
        with self._lock:
            lost, why = self._unregistered.get(conn.conn_id, (None, ""))
        where = (
            f"worker {conn.name!r} of job {conn.job!r} is {{}} registered with the scheduler at "
            f"{self._ctx.scheduler}: {why}"
        )
        if lost:
            conn.error(rid, "role_lost", where.format("no longer") + " (register again)")
            return fd
        if lost is not None and not self.fallback.enabled:  # re-registering: the scheduler would not know it
            result = local_pb2.PushResult(outcome=control_pb2.OUTCOME_DROPPED, reason=where.format("not"))
            conn.send(local_pb2.LocalEvent(request_id=rid, push_result=result))
            return fd
        loc = self._directory.lookup(conn.job, req.server)
        if loc is None:
            known = self._directory.servers(conn.job)
            conn.error(
                rid, "unknown_server", f"unknown server {req.server!r} in job {conn.job!r} (servers: {known})"
            )
            return fd
        if fd is None:
            conn.error(rid, "bad_request", "push without a payload memfd")
            return fd
        if req.base_version < 0:
            conn.error(
                rid,
                "bad_request",
                f"base_version {req.base_version} is negative: a model version is 0 or more",
            )
            return fd
        layouts = layouts_from_pb(req.tensors)
        problem = check_update(loc.spec, layouts, f"server {req.server!r} of job {conn.job!r}")
        header = FrameHeader(
            kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=req.payload_bytes, tensors=req.tensors
        )
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
            self._budget.acquire(req.payload_bytes, self._budget_timeout, self._ctx.stopping)
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
            ready_at=self._ctx.clock(),
            request_id=rid,
            owner=conn,
            crc32=req.payload_crc32 if req.has_crc32 else None,
        )
        self.outgoing.add(push)
        if self._on_push is not None:  # the stats: pushes and their bytes, by codec
            self._on_push(layouts, req.payload_bytes)
        accepted = local_pb2.PushAccepted(
            update_id=push.update_id, codec=self._directory.advice(conn.job, req.server)
        )
        conn.send(local_pb2.LocalEvent(request_id=rid, push_accepted=accepted))
        # re-registering: kept, announced once the worker is registered (or sent directly)
        reason = f"scheduler at {self._ctx.scheduler} not connected; {push.update_id} not scheduled"
        self.fallback.announce_or_keep(push, reason, announce=lost is None)
        return None

    def get(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """``GetRequest``: the server's model, at or above its ``min_version`` (roles/relay)."""
        req, rid = request.get, request.request_id
        job = conn.job
        loc = self._directory.lookup(job, req.server) if conn.role else None
        if loc is None:
            known = self._directory.servers(job)
            why = f"unknown server {req.server!r} in job {job!r} (servers: {known})"
            conn.error(rid, "unknown_server", why)
            return fd
        if req.has_min_version and req.min_version < 0:
            why = f"min_version {req.min_version} is negative: a model version is 0 or more"
            conn.error(rid, "bad_request", why)
            return fd
        floor = req.min_version if req.has_min_version else None
        self._models.local_get(conn, rid, job, req.server, floor, req.wait_seconds)
        return fd
