"""Replication on the daemons: the server's log, the div_max gate, forwarding, the replica's side.

A server with a replica (``mlfabric.register_as_replica``; docs/replication.md) keeps, on its
daemon, a :class:`ReplicationLog`: every update (or aggregate, or synchronous round) its
process applies after the replica attached is copied into a memfd with the server's version
after it, and reported to the scheduler (``ServerApplied``, with the L2 norm the server process
computed while it had the payload mapped). The scheduler decides when the entries go to the
replica (``ReplicateDirective``, up to a version); a forwarding thread sends them in version
order (an UPDATE frame with ``replica_version``), and the replica's daemon hands each to the
replica process, which runs the server's ``on_update`` on it — same code, same updates, same
order, so the replica is bit-identical once caught up.

The bound (paper §4, Fig. 3): the *divergence* is the sum of the norms of the entries the
server applied and the replica has not acknowledged. Before an update is handed to the server
process, :meth:`ReplicationLog.admit` waits while applying it would make the divergence exceed
``div_max`` — the server waits rather than diverge (``ReplicaStatus.blocked`` tells the
scheduler, which then forwards at once) — first come, first admitted, so that an update
beyond ``div_max`` is not overtaken for ever by smaller ones. ``div_max <= 0`` is chain
replication: the update's verdict (hence its push's result) waits until the replica has it;
so does an update whose own norm exceeds ``div_max``. If the scheduler gives no directive
while the server waits (``self_forward_after`` seconds), the daemon forwards on its own, as
pushes do when the scheduler is away.

The replica side is :func:`apply_replicated`: an entry is applied only at the next version
(up to :data:`WINDOW` entries travel at once, each waiting for the ones before it; a repeat
is acknowledged, a gap that does not fill within :data:`TURN_TIMEOUT` refused), and each
applied entry's update id — and its members' — is remembered, so once promoted the replica
answers a re-sent update from memory instead of applying it twice.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mlfabric.daemon.channels.frames import FileSpan, FrameHeader
from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.server.handoff import ServerHandoff
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

__all__ = ["LogEntry", "ReplicationLog", "ReplicationLogs", "apply_replicated", "copy_payload"]

_LOG = logging.getLogger("mlfabric.daemon.replication")
_APPLIED = control_pb2.OUTCOME_APPLIED
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_ACK = dataplane_pb2.FRAME_KIND_ACK

#: log entries on their way to the replica at once (the replica applies them in order)
WINDOW = 4
#: seconds a replicated entry waits at the replica for the entries before it
TURN_TIMEOUT = 10.0

#: ``request(address, header, payload) -> Reply`` (the push sender's pooled request)
Request = Callable[[str, Any, Any], Any]
#: ``report(DaemonMessage)`` to the scheduler (False when not connected)
Report = Callable[[Any], bool]


@dataclass
class LogEntry:
    """One applied payload not yet acknowledged by the replica (its bytes in ``fd``)."""

    version: int
    update_id: str
    header: Any
    fd: int
    nbytes: int
    norm: float


def copy_payload(src_fd: int, nbytes: int) -> int:
    """A new memfd holding the first ``nbytes`` of ``src_fd`` (a kernel-side copy)."""
    fd = os.memfd_create("mlfabric-replica-log", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        done = 0
        while done < nbytes:
            n = os.copy_file_range(src_fd, fd, nbytes - done, done, done)
            if n <= 0:
                raise OSError(f"copy of a log entry stopped at {done} of {nbytes} bytes")
            done += n
    except BaseException:
        os.close(fd)
        raise
    return fd


class ReplicationLog:
    """One server's replication log on its daemon (thread-safe).

    Parameters
    ----------
    job, server, replica : str
        The server and its replica's name.
    start_version : int
        The model version the replica started from (entries after it are logged).
    request, report : callable
        Send a frame to a peer daemon; send a message to the scheduler.
    host : str
        This host (in frames).
    self_forward_after : float
        Seconds a blocked server waits for the scheduler's directive before forwarding alone.
    announce : bool
        Report a ``ReplicaStatus`` now (the scheduler then counts the replica confirmed); a
        re-sync's log waits until the model reached the replica (:meth:`report_status`).
    """

    def __init__(
        self,
        job: str,
        server: str,
        replica: str,
        start_version: int,
        request: Request,
        report: Report,
        host: str,
        self_forward_after: float = 1.0,
        announce: bool = True,
    ) -> None:
        self.job, self.server, self.replica = job, server, replica
        self.address = ""
        self.div_max = 0.0
        self.acked = start_version
        self._request, self._report, self._host = request, report, host
        self._self_forward_after = self_forward_after
        self._cond = threading.Condition()
        self._entries: dict[int, LogEntry] = {}
        self._reserved = 0.0
        #: tickets of the updates waiting at :meth:`admit`, oldest first (first come, first admitted)
        self._waiting: collections.deque[int] = collections.deque()
        self._tickets = 0
        self._directed = start_version
        self._sending: set[int] = set()
        self._done: set[int] = set()
        self._closed = False
        self._server_failed = False
        self.error = ""
        #: seconds the server waited for its replica (the div_max bound), and how often
        self.blocked_seconds = 0.0
        self.blocked_count = 0
        self._thread = threading.Thread(target=self._forward_loop, name=f"replicate-{server}", daemon=True)
        self._thread.start()
        if announce:  # (a re-synced replica's log reports once the replica has the model)
            self._status()

    # ------------------------------------------------------------------ bound

    def divergence(self) -> float:
        """The sum of the norms of the entries the replica has not acknowledged."""
        with self._cond:
            return sum(e.norm for e in self._entries.values())

    def configure(self, address: str, div_max: float) -> None:
        """The replica's data-plane address and the job's ``div_max`` (a ``ReplicateDirective``)."""
        with self._cond:
            self.address, self.div_max = address, div_max
            self._cond.notify_all()

    def admit(self, norm: float) -> float:
        """Wait until an update of ``norm`` may be applied within ``div_max``; reserve it.

        First come, first admitted: an update waits while an update that came to the gate
        before it still waits (its ticket is not the oldest), so an update beyond ``div_max``,
        which needs a divergence of 0, is not overtaken for ever by smaller ones that fit
        beside the others; it waits at most for the log to drain. Returns the norm reserved
        (release it with :meth:`settle`). Chain replication (``div_max <= 0``) admits at once:
        its verdict waits instead (:meth:`settle`).
        """
        with self._cond:
            if self.div_max <= 0 or self._closed:
                return 0.0
            ticket = self._tickets
            self._tickets += 1
            self._waiting.append(ticket)
            try:
                return self._admit_in_turn(ticket, norm)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()

    def _admit_in_turn(self, ticket: int, norm: float) -> float:
        """:meth:`admit`'s wait, under the lock: until ``ticket`` is the oldest and ``norm`` fits."""
        t0 = time.monotonic()
        blocked = False
        while not self._closed and not (self._waiting[0] == ticket and self._fits(norm)):
            if not blocked:
                blocked = True
                self.blocked_count += 1
                self._status(blocked_norm=norm)
            waited = time.monotonic() - t0
            if waited >= self._self_forward_after:  # no directive came: forward alone
                self._directed = max(self._directed, max(self._entries, default=self.acked))
                self._cond.notify_all()
            self._cond.wait(0.05)
        if blocked:
            self.blocked_seconds += time.monotonic() - t0
        self._reserved += norm
        return norm

    def _fits(self, norm: float) -> bool:
        divergence = sum(e.norm for e in self._entries.values()) + self._reserved
        if norm > self.div_max:  # alone beyond the bound: only once the replica has caught up
            # (not == 0: reservations released in another order than taken leave ~1e-17 behind)
            return divergence <= self.div_max * 1e-9
        return divergence + norm <= self.div_max

    def settle(
        self,
        reserved: float,
        update_id: str,
        header: Any,
        verdict: Verdict,
        fd: int,
        nbytes: int,
        norm: float,
    ) -> Verdict:
        """An update's verdict came back: log it if it was applied; chain: wait for the replica.

        ``fd`` holds its payload (copied into the log); ``norm`` its L2 norm. Returns the
        verdict for the sender: the server's, or UNKNOWN when a chain-replicated update's server
        failed before the replica acknowledged it (the promoted replica may lack it).
        """
        applied = verdict.outcome == _APPLIED and verdict.version > self.acked
        entry_fd = copy_payload(fd, nbytes) if applied else -1
        with self._cond:
            self._reserved = max(0.0, self._reserved - reserved)
            if applied and not self._closed:
                self._entries[verdict.version] = LogEntry(
                    verdict.version, update_id, header, entry_fd, nbytes, norm
                )
                entry_fd = -1
            self._cond.notify_all()
        if entry_fd >= 0:
            os.close(entry_fd)
        if not applied:
            return verdict
        applied_msg = control_pb2.ServerApplied(
            job=self.job,
            server=self.server,
            update_id=update_id,
            version=verdict.version,
            norm=norm,
            bytes=nbytes,
        )
        self._report(control_pb2.DaemonMessage(server_applied=applied_msg))
        chained = self.div_max <= 0 or norm > self.div_max
        if chained and not self.wait_replicated(verdict.version) and self._server_failed:
            return Verdict.unknown(
                f"server {self.server!r} failed after applying {update_id} and before its replica "
                f"{self.replica!r} had it: the promoted replica may lack it",
                verdict.version,
            )
        return verdict

    def wait_replicated(self, version: int) -> bool:
        """Block until the replica acknowledged ``version`` (or the log closed); True if it did."""
        t0 = time.monotonic()
        with self._cond:
            while not self._closed and self.acked < version:
                if time.monotonic() - t0 >= self._self_forward_after:
                    self._directed = max(self._directed, version)
                    self._cond.notify_all()
                self._cond.wait(0.05)
            return self.acked >= version

    # ------------------------------------------------------------------ forwarding

    def direct(self, up_to_version: int) -> None:
        """The scheduler's directive: forward every entry up to ``up_to_version``."""
        with self._cond:
            self._directed = max(self._directed, up_to_version)
            self._cond.notify_all()

    def _next(self) -> LogEntry | None:
        """The next entry to send (directed, not on its way, within the window); None once closed."""
        with self._cond:
            while not self._closed:
                v = self.acked + 1
                while v in self._sending or v in self._done:
                    v += 1
                entry = self._entries.get(v)
                if entry is not None and v <= self._directed and self.address and v <= self.acked + WINDOW:
                    self._sending.add(v)
                    return entry
                self._cond.wait(0.5)
            return None

    def _forward_loop(self) -> None:
        with ThreadPoolExecutor(WINDOW, thread_name_prefix=f"replicate-{self.server}") as pool:
            while True:
                entry = self._next()
                if entry is None:
                    return
                pool.submit(self._send, entry)

    def _send(self, entry: LogEntry) -> None:
        """Send one entry; on its ACK drop it from the log and advance ``acked`` over what is done."""
        try:
            reply = self._request(self.address, self._frame(entry), FileSpan(entry.fd, 0, entry.nbytes))
            ok = reply.header.kind == _ACK and reply.header.version >= entry.version
            problem = "" if ok else f"replica answered {reply.header.reason or reply.header.kind!r}"
            reply.release()
        except ConnectionError as exc:  # PeerUnavailable, a broken connection
            ok, problem = False, f"replica {self.replica!r} at {self.address} unreachable: {exc}"
        if not ok:
            self.error = problem
            _LOG.warning(
                "replicating %s v%d of server %r: %s", entry.update_id, entry.version, self.server, problem
            )
            self._status(error=problem)
            time.sleep(0.2)
            with self._cond:
                self._sending.discard(entry.version)
                self._cond.notify_all()
            return
        with self._cond:
            self._sending.discard(entry.version)
            self._done.add(entry.version)
            done = self._entries.pop(entry.version, None)
            while self.acked + 1 in self._done:
                self.acked += 1
                self._done.discard(self.acked)
            self._cond.notify_all()
        if done is not None:
            os.close(done.fd)
        self.error = ""
        self._status()

    def _frame(self, entry: LogEntry) -> Any:
        h = entry.header
        return FrameHeader(
            kind=_UPDATE,
            update_id=entry.update_id,
            job=self.job,
            server=self.server,
            worker=h.worker,
            base_version=h.base_version,
            norm=h.norm,
            num_updates=h.num_updates or 1,
            tensors=h.tensors,
            payload_bytes=entry.nbytes,
            src_host=self._host,
            members=h.members,
            replica=self.replica,
            replica_version=entry.version,
        )

    def _status(self, blocked_norm: float = 0.0, error: str = "") -> None:
        status = control_pb2.ReplicaStatus(
            job=self.job,
            server=self.server,
            replica_version=self.acked,
            blocked=blocked_norm > 0,
            blocked_norm=blocked_norm,
            error=error,
        )
        self._report(control_pb2.DaemonMessage(replica_status=status))

    def report_status(self) -> None:
        """Tell the scheduler how far the replica is (``ReplicaStatus``)."""
        self._status()

    def close(self, server_failed: bool = False) -> None:
        """Forget the replica: free the entries, wake every waiter (the bound no longer holds).

        ``server_failed``: the server went away (not the replica): a chain-replicated update
        not yet at the replica is then answered UNKNOWN, not APPLIED.
        """
        with self._cond:
            self._closed = True
            self._server_failed = server_failed
            entries = list(self._entries.values())
            self._entries.clear()
            self._cond.notify_all()
        for e in entries:
            os.close(e.fd)


class ReplicationLogs:
    """The replication logs of this host's servers, by (job, server) (thread-safe).

    A log is created when the replica's daemon fetches the model to attach (:meth:`attach`,
    at the version it gets); a ``ReplicateDirective`` sets its address and bound (it may
    arrive first: it is kept until the log exists) and directs forwarding.
    """

    def __init__(self, host: str, request: Request, report: Report, self_forward_after: float = 1.0) -> None:
        self.host = host
        self._request, self._report = request, report
        self._self_forward_after = self_forward_after
        self._lock = threading.Lock()
        self._logs: dict[tuple[str, str], ReplicationLog] = {}
        self._config: dict[tuple[str, str], tuple[str, float, int]] = {}
        self._norms: dict[str, float] = {}

    def get(self, job: str, server: str) -> ReplicationLog | None:
        """The server's log, or None (no replica attached)."""
        with self._lock:
            return self._logs.get((job, server))

    def attach(
        self, job: str, server: str, replica: str, version: int, *, announce: bool = True
    ) -> ReplicationLog:
        """Start logging for ``replica`` from ``version`` (a replacing attach closes the old log).

        ``announce=False`` (a re-sync): the log reports nothing and ignores a directive kept
        for it until its caller configures it, once the replica has the model.
        """
        log = ReplicationLog(
            job, server, replica, version, self._request, self._report, self.host,
            self._self_forward_after, announce,
        )  # fmt: skip
        with self._lock:
            old = self._logs.get((job, server))
            self._logs[(job, server)] = log
            config = self._config.pop((job, server), None)
        if old is not None:
            old.close()
        if config is not None and announce:
            log.configure(config[0], config[1])
            log.direct(config[2])
        return log

    def drop(self, job: str, server: str, log: ReplicationLog) -> None:
        """Close ``log`` and forget it, if it is still the server's log (a failed re-sync)."""
        with self._lock:
            if self._logs.get((job, server)) is log:
                del self._logs[(job, server)]
        log.close()

    def on_directive(self, d: Any) -> None:
        """A ``ReplicateDirective``: configure, direct, or detach the server's log."""
        key = (d.job, d.server)
        with self._lock:
            log = self._logs.get(key)
            if d.detach:
                self._logs.pop(key, None)
                self._config.pop(key, None)
            elif log is None:
                self._config[key] = (d.replica_address, d.div_max, d.up_to_version)
        if d.detach:
            if log is not None:
                log.close()
            return
        if log is not None:
            if d.replica_address:  # (re-)attach: a restarted scheduler learns where the replica is
                log.configure(d.replica_address, d.div_max)
                log.report_status()
            log.direct(d.up_to_version)

    def note_norm(self, update_id: str, norm: float) -> None:
        """The server process's L2 norm of an update it applied (from its verdict)."""
        with self._lock:
            self._norms[update_id] = norm
            while len(self._norms) > 10_000:
                self._norms.pop(next(iter(self._norms)))

    def take_norm(self, update_id: str, default: float) -> float:
        """The norm noted for ``update_id`` (forgotten), else ``default``."""
        with self._lock:
            return self._norms.pop(update_id, default)

    def close(self, job: str, server: str) -> None:
        """The server went away here: close its log."""
        with self._lock:
            log = self._logs.pop((job, server), None)
        if log is not None:
            log.close(server_failed=True)

    def close_all(self) -> None:
        """Close every log (shutdown)."""
        with self._lock:
            logs = list(self._logs.values())
            self._logs.clear()
        for log in logs:
            log.close(server_failed=True)


def apply_replicated(handoff: ServerHandoff, header: Any, hand_off: Callable[[], Verdict]) -> Verdict:
    """A replicated entry at the replica: apply it at the next version only.

    Returns the verdict for the ACK: the stored state for an entry the replica already has
    (version at or below its own), a refusal (DROPPED naming both versions) for a gap, else
    ``hand_off()``'s verdict from the replica process. An applied entry's members are
    remembered under their ids (an aggregate's).
    """
    deadline = time.monotonic() + TURN_TIMEOUT
    while header.replica_version > handoff.version + 1 and time.monotonic() < deadline:
        time.sleep(0.0005)  # an entry sent ahead (the window): wait for the ones before it
    with handoff.replicating:  # not beside a re-sync, which moves the version
        have = handoff.version
        if header.replica_version <= have:
            return Verdict(_APPLIED, 0, have, "")
        if header.replica_version != have + 1:
            return Verdict.dropped(
                f"replica of server {handoff.name!r} is at version {have}; entry {header.update_id} is "
                f"version {header.replica_version} (entries are applied in order)",
                have,
            )
        verdict = hand_off()
    if verdict.outcome == _APPLIED:
        for m in header.members:
            handoff.verdicts.resolve(
                m.update_id, Verdict(_APPLIED, verdict.version - 1 - m.base_version, verdict.version, "")
            )
        if verdict.version != header.replica_version:
            _LOG.error(
                "replica of server %r applied %s at version %d, the server at %d: the replica diverged",
                handoff.name,
                header.update_id,
                verdict.version,
                header.replica_version,
            )
    return verdict


def seed_memory(handoff: ServerHandoff, applied_ids: Any, version: int) -> None:
    """Remember the ids the server applied before the replica attached (its model has them)."""
    for update_id in applied_ids:
        handoff.verdicts.resolve(update_id, Verdict(_APPLIED, 0, version, ""))
