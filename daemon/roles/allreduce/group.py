"""All-reduces a process group runs: the daemon only carries their plans (docs/allreduce.md).

A participant joined with a ``torch.distributed`` process group asks for an operation's plan
once (``AllreduceRequest`` with ``plan_only``, no payload); its daemon announces it like any
all-reduce (``AllreduceReady`` with the process rank and the operation's signature), the
scheduler agrees it with the other participants and plans it for the group, and the
``AllreduceDirective`` that comes back (``executor_kind`` set) goes to the process as
``AllreducePlan``. The process runs the plan itself, on every later call too. A directive with
``seq`` 0 is a newer plan of an operation planned before (the bandwidth graph changed): it goes
to the participant's process unasked (``request_id`` 0).

The mismatch, lost-participant, timeout and no-scheduler rules are those of every all-reduce,
for as long as the participant waits for its plan: an ``AllreduceAbort``, the process
disconnecting, the deadline or the scheduler stream breaking answer it with a ``LocalError``
(and the scheduler is told where it does not know yet).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.roles.allreduce.op import Key, ready_message
from mlfabric.proto.v1 import control_pb2, local_pb2

__all__ = ["GroupPlans"]


@dataclass
class _Waiting:
    conn: LocalConnection
    request_id: int
    deadline: float
    started: float


class GroupPlans:
    """The plan requests of this daemon's process-group participants (thread-safe).

    Parameters
    ----------
    control : callable
        ``control(DaemonMessage) -> bool`` on the scheduler stream (False: not connected).
    clock : callable
        Monotonic seconds.

    Examples
    --------
    >>> sent = []
    >>> plans = GroupPlans(lambda m: sent.append(m) or True, lambda: 0.0)
    >>> class Conn:
    ...     events = []
    ...     def send(self, event, fd=None):
    ...         self.events.append(event)
    ...         return True
    >>> conn = Conn()
    >>> req = local_pb2.AllreduceRequest(job="j", name="g", seq=1, participant="r0", world_size=2,
    ...                                  plan_only=True, process_rank=0, signature=9)
    >>> plans.request(conn, req, 5, timeout=30.0)
    >>> sent[0].allreduce_ready.plan_only, sent[0].allreduce_ready.process_rank
    (True, 0)
    >>> d = control_pb2.AllreduceDirective(job="j", name="g", seq=1, participant="r0",
    ...                                    executor_kind="native", epoch=0, signature=9)
    >>> plans.directive(d)
    >>> conn.events[0].request_id, conn.events[0].allreduce_plan.kind
    (5, 'native')
    """

    def __init__(self, control: Callable[[Any], bool], clock: Callable[[], float]) -> None:
        self._control = control
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting: dict[Key, _Waiting] = {}
        #: (job, participant) -> its process's connection, for the plans pushed later
        self._participants: dict[tuple[str, str], LocalConnection] = {}

    def request(self, conn: LocalConnection, req: Any, request_id: int, *, timeout: float) -> None:
        """A plan-only ``AllreduceRequest`` (checked): announce it and wait for its plan."""
        key: Key = (req.job, req.name, int(req.seq), req.participant)
        now = self._clock()
        with self._lock:
            if key in self._waiting:
                taken = True
            else:
                taken = False
                self._waiting[key] = _Waiting(conn, request_id, now + timeout, now)
                self._participants[(req.job, req.participant)] = conn
        if taken:
            conn.error(request_id, "bad_request", f"{_label(key)} is already waiting for its plan")
            return
        ready = ready_message(
            req,
            req.payload_bytes,
            timeout,
            plan_only=True,
            process_rank=req.process_rank,
            signature=req.signature,
        )
        if not self._control(control_pb2.DaemonMessage(allreduce_ready=ready)):
            self._fail(key, "unavailable", f"{_label(key)}: the scheduler is not connected", tell=False)

    def directive(self, d: Any) -> None:
        """An ``AllreduceDirective`` with ``executor_kind``: the plan to the process (pushed: ``seq`` 0)."""
        plan = local_pb2.AllreducePlan(
            job=d.job,
            name=d.name,
            signature=d.signature,
            epoch=d.epoch,
            kind=d.executor_kind,
            parent_ranks=d.parent_ranks,
            chunk_bytes=d.chunk_bytes,
            plan=d.plan,
            model_seconds=d.model_seconds,
        )
        if d.seq == 0:
            with self._lock:
                conn = self._participants.get((d.job, d.participant))
            if conn is not None:
                conn.send(local_pb2.LocalEvent(request_id=0, allreduce_plan=plan))
            return
        with self._lock:
            waiting = self._waiting.pop((d.job, d.name, int(d.seq), d.participant), None)
        if waiting is not None:
            waiting.conn.send(local_pb2.LocalEvent(request_id=waiting.request_id, allreduce_plan=plan))

    def abort(self, a: Any) -> None:
        """``AllreduceAbort``: every local participant waiting for that operation's plan gets its error."""
        with self._lock:
            keys = [k for k in self._waiting if k[:3] == (a.job, a.name, int(a.seq))]
        for key in keys:
            self._fail(key, a.code or "allreduce_failed", a.reason, tell=False)

    def connection_closed(self, conn: LocalConnection) -> None:
        """The process went away: its waiting requests fail (the scheduler aborts them elsewhere)."""
        with self._lock:
            keys = [k for k, w in self._waiting.items() if w.conn is conn]
            for p in [p for p, c in self._participants.items() if c is conn]:
                del self._participants[p]
        for key in keys:
            self._fail(
                key, "allreduce_peer_lost", f"participant {key[3]!r}'s process disconnected from its daemon"
            )

    def scheduler_lost(self, reason: str) -> None:
        """The control stream broke: every waiting request fails (the scheduler forgets them too)."""
        with self._lock:
            keys = list(self._waiting)
        for key in keys:
            self._fail(key, "unavailable", f"scheduler connection lost: {reason}", tell=False)

    def tick(self) -> None:
        """Fail the requests past their deadline."""
        now = self._clock()
        with self._lock:
            late = [(k, w) for k, w in self._waiting.items() if now > w.deadline]
        for key, w in late:
            waited = w.deadline - w.started
            reason = f"{_label(key)}: no plan within {waited:g} s (waiting for the other participants)"
            self._fail(key, "allreduce_timeout", reason)

    def stop(self, host: str) -> None:
        """Fail every waiting request (the daemon is stopping)."""
        with self._lock:
            keys = list(self._waiting)
        for key in keys:
            self._fail(key, "unavailable", f"daemon of host {host!r} shut down")

    def _fail(self, key: Key, code: str, reason: str, *, tell: bool = True) -> None:
        with self._lock:
            waiting = self._waiting.pop(key, None)
        if waiting is None:
            return
        waiting.conn.error(waiting.request_id, code, reason)
        if tell:
            job, name, seq, participant = key
            done = control_pb2.AllreduceDone(
                job=job, name=name, seq=seq, participant=participant, ok=False, reason=reason, code=code
            )
            self._control(control_pb2.DaemonMessage(allreduce_done=done))


def _label(key: Key) -> str:
    job, name, seq, participant = key
    return f"all-reduce {name!r}#{seq} of job {job!r} (participant {participant!r})"
