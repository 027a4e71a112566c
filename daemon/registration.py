"""A host daemon's side of its scheduler session: registrations, directives, re-registration.

:class:`SchedulerSession` is the part of :class:`~mlfabric.daemon.host.Daemon` that talks to
the scheduler over the control stream (DESIGN §3): it sends ``RegisterRole`` and hands each
``RoleAck`` to its waiter, dispatches the scheduler's directives (send, drop, resolve,
aggregate, job update) to the push sender, the aggregator role and the directory, and when the
stream breaks hands the pushes waiting for a directive to the fallback
(:mod:`mlfabric.daemon.roles.worker.fallback`) and, once it is back, re-registers the roles of this host's
processes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlfabric.daemon.channels.control import ControlStream
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.roles.aggregator.role import AggregatorRole
from mlfabric.daemon.roles.allreduce.role import AllreduceRole
from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.replica.log import ReplicationLogs
from mlfabric.daemon.roles.replica.role import promote, reregister_replicas, send_resync
from mlfabric.daemon.roles.server.serving import ServerRoles
from mlfabric.daemon.roles.worker.fallback import Fallback
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes
from mlfabric.daemon.roles.worker.sender import PushSender
from mlfabric.proto.v1 import control_pb2

__all__ = ["SchedulerSession"]

_LOG = logging.getLogger("mlfabric.daemon")


class SchedulerSession:
    """The control-stream handlers of a daemon (a base of :class:`~mlfabric.daemon.host.Daemon`).

    The daemon builds the parts named below in its constructor; this class holds no state of
    its own.
    """

    _lock: threading.Lock
    _acks: dict[int, Callable[[Any], None]]
    _ack_ids: Iterator[int]
    _control: ControlStream
    _roles: dict[int, LocalConnection]
    _unregistered: dict[int, tuple[bool, str]]
    _stopping: threading.Event
    _tasks: ThreadPoolExecutor
    serving: ServerRoles
    sender: PushSender
    fallback: Fallback
    directory: Directory
    aggregator: AggregatorRole
    outgoing: OutgoingPushes
    replication: ReplicationLogs
    allreduce: AllreduceRole

    def _register(self, message: Any, on_ack: Callable[[Any], None]) -> None:
        """Send ``RegisterRole``; ``on_ack(RoleAck or None)`` (None: no scheduler)."""
        request_id = next(self._ack_ids)
        message.request_id = request_id
        with self._lock:
            self._acks[request_id] = on_ack
        if not self._control.send(control_pb2.DaemonMessage(register_role=message)):
            with self._lock:
                self._acks.pop(request_id, None)
            on_ack(None)

    def _on_connected(self, welcome: Any) -> None:
        """A (re)welcomed session: re-register the roles of this host's processes."""
        self.fallback.connected()
        with self._lock:
            workers = [c for c in self._roles.values() if c.role == "worker"]
            for c in workers:
                self._unregistered[c.conn_id] = (False, "re-registering after the scheduler restarted")
        for message in self.serving.registrations():
            self._reregister(message, None)
        reregister_replicas(self)
        for c in workers:
            message = control_pb2.RegisterRole(job=c.job, name=c.name, role=control_pb2.ROLE_WORKER)
            self._reregister(message, c)

    def _reregister(self, message: Any, conn: LocalConnection | None, pause: float = 0.0) -> None:
        """Register ``message`` again (``conn``: the worker's connection, None for a server).

        A worker refused because its job has no server (the server's daemon is not back yet)
        retries with backoff (0.2 s doubling to 2 s) for as long as its process is connected,
        whatever the order daemons come back in; until then its pushes are kept (announced once
        it is registered, or sent directly after ``fallback_after``), or without a fallback
        resolve DROPPED naming that. Refused for another reason, its role is gone for good: its
        pushes get an error.
        """
        if self._stopping.wait(pause):
            return
        conn_id = -1 if conn is None else conn.conn_id

        def on_ack(ack: Any) -> None:
            if conn is not None:
                with self._lock:
                    if self._roles.get(conn.conn_id) is not conn:
                        return  # the worker's process went away meanwhile
                    if ack is not None and ack.code == control_pb2.ERROR_CODE_UNKNOWN_JOB:
                        why = f"refused ({ack.error}); retrying until the job's server is back"
                        self._unregistered[conn_id] = (False, why)
                    elif ack is not None and ack.ok:
                        self._unregistered.pop(conn_id, None)
                    elif ack is not None:
                        self._unregistered[conn_id] = (True, ack.error)
                if ack is not None and ack.code == control_pb2.ERROR_CODE_UNKNOWN_JOB:
                    self._tasks.submit(self._reregister, message, conn, min(2.0, max(0.2, 2 * pause)))
                    return
            self._log_reregistration(message.job, message.name, ack)
            if conn is not None and ack is not None and ack.ok:  # pushes held for an aggregate it never saw
                for ready in self.sender.unhold(message.job, message.name):
                    self._control.send(control_pb2.DaemonMessage(update_ready=ready))
                self.fallback.announce_worker(message.job, message.name)  # kept while it was away

        self._register(message, on_ack)

    def _log_reregistration(self, job: str, name: str, ack: Any) -> None:
        if ack is None or not ack.ok:
            _LOG.error("re-registering %r of job %r failed: %s", name, job, ack and ack.error)
        elif ack.servers:
            self.directory.update(job, ack.servers)

    def _on_disconnected(self, reason: str) -> None:
        with self._lock:
            acks = list(self._acks.values())
            self._acks.clear()
        for on_ack in acks:
            on_ack(None)
        self.aggregator.abandon_all(f"scheduler connection lost: {reason}")
        self.allreduce.scheduler_lost(reason)
        if self.fallback.enabled:  # waiting pushes keep their place (sent directly if it stays away)
            self.fallback.lost()
            return
        for push in self.outgoing.take_waiting():
            self.sender.finish(
                push, Verdict.dropped(f"scheduler connection lost before {push.update_id} was sent: {reason}")
            )

    def _on_directive(self, directive: Any) -> None:
        kind = directive.WhichOneof("kind")
        if kind == "role_ack":
            with self._lock:
                on_ack = self._acks.pop(directive.role_ack.request_id, None)
            if on_ack is not None:
                on_ack(directive.role_ack)
        elif kind == "aggregate":
            self.aggregator.on_directive(directive.aggregate)
        elif kind == "allreduce":
            self.allreduce.on_directive(directive.allreduce)
        elif kind == "allreduce_abort":
            self.allreduce.on_abort(directive.allreduce_abort)
        elif kind == "resolve":
            self.sender.resolve(directive.resolve)
        elif kind == "send" and self.aggregator.names_aggregate(directive.send.update_id):
            self._tasks.submit(self.aggregator.forward, directive.send)
        elif kind == "drop" and self.aggregator.drop(directive.drop.update_id, directive.drop.reason):
            pass  # an aggregate this host ran
        elif kind == "send":
            push = self.outgoing.start_sending(directive.send.update_id)
            if push is None:
                _LOG.warning("send directive for unknown or busy update %r", directive.send.update_id)
            else:
                self._tasks.submit(self.sender.transfer, push, directive.send)
        elif kind == "drop":
            dropped = self.outgoing.take(directive.drop.update_id)
            if dropped is not None:
                self.sender.finish(
                    dropped, Verdict.dropped(directive.drop.reason or "dropped by the scheduler")
                )
        elif kind == "replicate" and directive.replicate.resync and not directive.replicate.detach:
            self._tasks.submit(send_resync, self, directive.replicate)  # sends the model: not inline
        elif kind == "replicate":
            self.replication.on_directive(directive.replicate)
        elif kind == "promote":
            promote(self, directive.promote)
        elif kind == "job_update":
            # a JobUpdate lists the job's servers now: one that left is forgotten
            self.directory.update(directive.job_update.job, directive.job_update.servers, replace=True)
