"""Graceful degradation: direct sends while the scheduler is unreachable (DESIGN §3).

The scheduler only decides when an update moves (MLfabric §4); the bytes never pass through
it. So when its control stream is down for longer than ``after`` seconds, a daemon need not
drop the pushes it holds: it falls back to *direct sends* — each waiting update goes straight
to its server's daemon, whose data address the daemon knows from the last ``RoleAck`` or
``JobUpdate`` (:class:`~mlfabric.daemon.roles.directory.Directory`). Concurrent direct sends share the
links as TCP shares them (plain fair sharing). tau_max is still enforced where it always is:
the server compares each update's ``base_version`` with its version and drops a stale one.

Exactly-once holds as before. A push is *unannounced* when no live scheduler session knows
it: accepted while the stream was down, or announced to a session that ended (a scheduler
forgets a disconnected daemon's pending updates). Each unannounced push leaves that state
exactly once, under one lock, either by being announced to the new session (when its worker
is registered again) or by a direct send; a push sent directly is never announced again, so
the scheduler cannot send it a second time. The server's daemon de-duplicates by
``update_id`` in any case.

:class:`Fallback` does no I/O itself: the daemon passes in how to announce a push and how to
send it; :meth:`Fallback.tick` is called periodically (:class:`~mlfabric.daemon.host.Ticker`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from mlfabric.aggregators.codecs.payload import wire_summary
from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes, PendingPush
from mlfabric.proto.v1 import control_pb2

__all__ = ["DEFAULT_FALLBACK_AFTER", "Fallback", "direct_send", "update_ready"]

_LOG = logging.getLogger("mlfabric.daemon.fallback")

#: Seconds without a scheduler before a daemon sends directly (``--fallback-after``).
DEFAULT_FALLBACK_AFTER = 2.0


def update_ready(push: PendingPush) -> Any:
    """The ``UpdateReady`` that announces ``push`` to the scheduler.

    Examples
    --------
    >>> p = PendingPush("h1/x/1", "j", "ps0", "w0", -1, [], 8, 1.0, 3, 0.5, 1, 0)
    >>> m = update_ready(p)
    >>> m.update_id, m.bytes, m.base_version, m.codec
    ('h1/x/1', 8, 3, '')
    """
    codec, _ = wire_summary(push.layouts)
    return control_pb2.UpdateReady(
        update_id=push.update_id,
        job=push.job,
        server=push.server,
        worker=push.worker,
        bytes=push.payload_bytes,
        norm=push.norm,
        base_version=push.base_version,
        ready_at=push.ready_at,
        resent=push.resent,
        codec=codec if codec != "none" else "",
    )


def direct_send(directory: Directory, push: PendingPush) -> Any:
    """The ``SendDirective`` a daemon gives itself to send ``push`` straight to its server.

    Returns None when the server's location is not known (no ``RoleAck``/``JobUpdate`` named it).

    Examples
    --------
    >>> from mlfabric.daemon.roles.directory import ServerLocation
    >>> d = Directory()
    >>> d.add("j", ServerLocation("ps0", "h9", "10.0.0.9:7000", {}, 0))
    >>> p = PendingPush("h1/x/1", "j", "ps0", "w0", -1, [], 8, 1.0, 0, 0.0, 1, 0)
    >>> s = direct_send(d, p)
    >>> s.update_id, s.next_hop_host, s.next_hop_address, s.aggregate_id
    ('h1/x/1', 'h9', '10.0.0.9:7000', '')
    """
    loc = directory.lookup(push.job, push.server)
    if loc is None or not loc.data_address:
        return None
    return control_pb2.SendDirective(
        update_id=push.update_id,
        next_hop_host=loc.host,
        next_hop_address=loc.data_address,
        dst_host=loc.host,
    )


class Fallback:
    """Keeps pushes the scheduler does not know, and sends them directly when it stays away.

    Parameters
    ----------
    after : float or None
        Seconds a push may stay unannounced (and the scheduler away) before it is sent
        directly; None: no fallback (pushes waiting for a lost scheduler resolve DROPPED).
    outgoing : OutgoingPushes
        The daemon's pushes.
    directory : Directory
        Where the servers are.
    announce : callable
        ``announce(push) -> bool`` tells the scheduler ``UpdateReady``; False if not connected.
    transfer : callable
        ``transfer(push, send_directive)`` sends a push (already marked sending) and resolves it
        (the daemon runs it on its task pool).
    finish : callable
        ``finish(push, verdict)`` resolves a push taken from ``outgoing``.
    clock : callable
        Monotonic seconds.

    Examples
    --------
    >>> from mlfabric.daemon.roles.directory import ServerLocation
    >>> book, d, now = OutgoingPushes("h1", "x"), Directory(), [0.0]
    >>> d.add("j", ServerLocation("ps0", "h9", "10.0.0.9:7000", {}, 0))
    >>> sent, told = [], []
    >>> fb = Fallback(2.0, book, d, lambda p: told.append(p.update_id) or True,
    ...               lambda p, s: sent.append(s.next_hop_address), print, lambda: now[0])
    >>> book.add(PendingPush("h1/x/1", "j", "ps0", "w0", -1, [], 8, 1.0, 0, 0.0, 1, 0))
    >>> fb.lost()                   # the scheduler went away: the push is unannounced
    >>> now[0] = 1.0; fb.tick(); sent
    []
    >>> now[0] = 2.5; fb.tick(); sent, fb.active
    (['10.0.0.9:7000'], True)
    >>> fb.connected(); fb.active
    False
    """

    def __init__(
        self,
        after: float | None,
        outgoing: OutgoingPushes,
        directory: Directory,
        announce: Callable[[PendingPush], bool],
        transfer: Callable[[PendingPush, Any], None],
        finish: Callable[[PendingPush, Verdict], None],
        clock: Callable[[], float],
    ) -> None:
        if after is not None and after < 0:
            raise ValueError(f"fallback_after must be >= 0 seconds or None, got {after}")
        self.after = after
        self._outgoing = outgoing
        self._directory = directory
        self._announce = announce
        self._transfer = transfer
        self._finish = finish
        self._clock = clock
        self._lock = threading.Lock()
        #: update id -> since when no live scheduler session knows it
        self._unannounced: dict[str, float] = {}
        self._down_since: float | None = None
        #: Whether the daemon is sending directly now (the scheduler away for ``after`` s).
        self.active = False
        #: Pushes sent directly so far (for tests and metrics).
        self.direct_sends = 0

    @property
    def enabled(self) -> bool:
        """Whether pushes are kept (and eventually sent directly) while the scheduler is away."""
        return self.after is not None

    def unannounced(self) -> int:
        """How many pushes no scheduler session knows now."""
        with self._lock:
            return len(self._unannounced)

    def lost(self) -> None:
        """The scheduler session ended: every push still waiting for a directive is unannounced."""
        now = self._clock()
        ids = self._outgoing.waiting_ids()
        with self._lock:
            if self._down_since is None:
                self._down_since = now
            for update_id in ids:
                self._unannounced.setdefault(update_id, now)
        _LOG.warning(
            "scheduler lost: %d pushes kept; sending directly if it is not back within %s s",
            len(ids),
            self.after,
        )

    def connected(self) -> None:
        """A session was welcomed: back to scheduled sends (pushes are announced per worker)."""
        with self._lock:
            was, self.active, self._down_since = self.active, False, None
        if was:
            _LOG.warning(
                "scheduler back: scheduled sends again (%d pushes were sent directly)", self.direct_sends
            )

    def keep(self, push: PendingPush) -> bool:
        """Keep a push the scheduler could not be told about; False when there is no fallback.

        While falling back the push is sent directly at once, else it waits to be announced.
        """
        if self.after is None:
            return False
        with self._lock:
            self._unannounced[push.update_id] = self._clock()
            active = self.active
        if active:
            self._send_directly([push.update_id])
        return True

    def announce_or_keep(self, push: PendingPush, reason: str, *, announce: bool = True) -> None:
        """Tell the scheduler about ``push``; if it cannot be told, keep it; else resolve it DROPPED.

        The one place of "announce, or keep for the fallback, or drop" (a new push, and a push
        announced again after its server failed over). ``announce`` False: keep it without
        trying (its worker is being registered again: the session would not know it).
        ``reason`` is the DROPPED reason when there is no fallback.
        """
        if announce and self._announce(push):
            return
        if self.keep(push):
            return
        taken = self._outgoing.take(push.update_id)
        if taken is not None:
            self._finish(taken, Verdict.dropped(reason))

    def announce_worker(self, job: str, worker: str) -> int:
        """The worker is registered with the new session: announce its unannounced pushes.

        Returns how many were announced. A push that cannot be announced (the stream broke
        again) stays unannounced.
        """
        announced = 0
        with self._lock:
            for update_id in list(self._unannounced):
                push = self._outgoing.waiting(update_id)
                if push is None:
                    self._unannounced.pop(update_id)  # resolved or sent meanwhile
                    continue
                if (push.job, push.worker) != (job, worker):
                    continue
                if self._announce(push):
                    del self._unannounced[update_id]
                    announced += 1
        return announced

    def tick(self) -> None:
        """Enter fallback when the scheduler has been away ``after`` s; send due pushes directly."""
        if self.after is None:
            return
        now = self._clock()
        with self._lock:
            if self._down_since is not None and now - self._down_since >= self.after and not self.active:
                self.active = True
                _LOG.warning(
                    "scheduler unreachable for %.1f s: sending %d pushes directly to their servers",
                    now - self._down_since,
                    len(self._unannounced),
                )
            due = [u for u, since in self._unannounced.items() if self.active or now - since >= self.after]
        if due:
            self._send_directly(due)

    def _send_directly(self, update_ids: Iterable[str]) -> None:
        for update_id in update_ids:
            with self._lock:
                if self._unannounced.pop(update_id, None) is None:
                    continue  # announced (or sent) by someone else meanwhile
                push = self._outgoing.start_sending(update_id)
            if push is None:
                continue  # resolved meanwhile
            send = direct_send(self._directory, push)
            if send is None:
                taken = self._outgoing.take(update_id)
                if taken is not None:
                    reason = (
                        f"scheduler unreachable and the address of server {push.server!r} of job "
                        f"{push.job!r} is unknown; {update_id} not sent"
                    )
                    self._finish(taken, Verdict.dropped(reason))
                continue
            self.direct_sends += 1
            self._transfer(push, send)
