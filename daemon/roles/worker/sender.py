"""The worker side of a daemon: moving held updates to their next hop, and resolving them.

On a ``SendDirective`` the daemon sends the update's memfd with ``sendfile`` to the next hop
(MLfabric §4: daemons move the bytes, the scheduler only decides), through
:meth:`~mlfabric.daemon.channels.peers.PeerPool.deliver`: a peer that certainly got nothing is
retried a bounded number of times with exponential backoff, and then the push resolves DROPPED
naming the peer and the error; a frame that may have reached the server's daemon is never sent
again and the push resolves UNKNOWN. An ACK resolves it with the server's verdict; a send to
an aggregator keeps it HELD until the aggregate's verdict. Either way the push is resolved
(never silently lost) and the transfer is reported to the scheduler with its bytes, start, end,
measured throughput and outcome. A transfer to a replicated server that failed over is
announced again instead (docs/replication.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from mlfabric.daemon.channels.frames import FileSpan, FrameHeader
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.daemon.roles.base import RoleContext, Verdict
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.worker.fallback import update_ready
from mlfabric.daemon.roles.worker.pushes import OutgoingPushes, PendingPush, PushState
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.wire.tensors import layouts_to_pb

__all__ = ["PushSender"]

_LOG = logging.getLogger("mlfabric.daemon")
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_ACK = dataplane_pb2.FRAME_KIND_ACK
_DROPPED = control_pb2.OUTCOME_DROPPED

#: seconds an update whose transfer to a replicated server failed waits for the failover
FAILOVER_WAIT = 3.0


class PushSender:
    """Executes send directives for the pushes a daemon holds, and resolves them.

    Parameters
    ----------
    context : RoleContext
        This daemon's host name, its stopping flag.
    pool : PeerPool
        Connections to peer daemons (its ``deliver`` retries and says when a frame may have
        arrived).
    outgoing : OutgoingPushes
        The pushes held until they resolve.
    report : callable
        ``report(TransferReport)`` sends a report to the scheduler.
    directory : Directory
        Where the servers are (a failed-over server's new place).
    reannounce : callable, optional
        ``reannounce(push, reason)`` announces a push again (its server failed over; the
        fallback's :meth:`~mlfabric.daemon.roles.worker.fallback.Fallback.announce_or_keep`);
        None: a push is never re-routed.
    on_finish : callable, optional
        ``on_finish(push)`` after a push resolved (the worker role gives back its push budget).
    on_stale_hold : callable, optional
        ``on_stale_hold(push)`` when a push is held after a send to an aggregator directed by
        a scheduler session that has ended meanwhile (:attr:`session` moved on): the session
        that would resolve it is gone, so the worker role hands it to :meth:`unhold_one` once
        its worker is registered with the new one (or leaves it to :meth:`unhold` until then).
    """

    def __init__(
        self,
        context: RoleContext,
        pool: PeerPool,
        outgoing: OutgoingPushes,
        report: Callable[[Any], Any],
        directory: Directory,
        *,
        reannounce: Callable[[PendingPush, str], None] | None = None,
        on_finish: Callable[[PendingPush], None] | None = None,
        on_stale_hold: Callable[[PendingPush], None] | None = None,
    ) -> None:
        self._ctx = context
        self.host = context.host
        self._pool = pool
        self.outgoing = outgoing
        self._report = report
        self._directory = directory
        self._reannounce = reannounce
        self._on_finish = on_finish
        self._on_stale_hold = on_stale_hold
        #: the current scheduler session (:meth:`new_session`); a push records the one that sent it
        self.session = 0
        self._lock = threading.Lock()
        #: held pushes an aggregator summed (ACKed): update id -> (aggregate id, aggregator host)
        self._summed: dict[str, tuple[str, str]] = {}

    def finish(self, push: PendingPush, verdict: Verdict) -> None:
        """Resolve a push: close its memfd, tell its process."""
        with self._lock:
            self._summed.pop(push.update_id, None)
        os.close(push.fd)
        result = local_pb2.PushResult(
            update_id=push.update_id,
            outcome=verdict.outcome,
            delay=verdict.delay,
            version=verdict.version,
            reason=verdict.reason,
        )
        _LOG.debug("push %s resolved %s (version %d)", push.update_id, verdict.outcome, verdict.version)
        push.owner.send(local_pb2.LocalEvent(request_id=push.request_id, push_result=result))
        if self._on_finish is not None:
            self._on_finish(push)

    def transfer(self, push: PendingPush, send: Any) -> None:
        """Move one update to its next hop (retrying a vanished peer), then resolve and report it.

        The push resolves whatever happens: a memfd the pushing process shrank after the push
        was accepted (a short read) resolves DROPPED naming both sizes, without a retry, and
        so does any other error while sending (named in the reason).
        """
        size = os.fstat(push.fd).st_size
        if size < push.payload_bytes:
            self._fail(push, send, self._short(push, size))
            return
        try:
            self._transfer(push, send)
        except EOFError as exc:  # the memfd shrank while it was being sent
            self._fail(push, send, self._short(push, os.fstat(push.fd).st_size, exc))
        except Exception as exc:  # noqa: BLE001 - resolved DROPPED naming the error: a push never hangs
            _LOG.exception("transfer of %s failed", push.update_id)
            self._fail(push, send, f"transfer of {push.update_id} failed: {exc!r}")

    def _short(self, push: PendingPush, size: int, exc: BaseException | None = None) -> str:
        return (
            f"the payload memfd of {push.update_id} holds {size} bytes, fewer than the "
            f"{push.payload_bytes} the push announced (shrunk by the pushing process after the "
            f"push was accepted){f': {exc}' if exc else ''}"
        )

    def _fail(self, push: PendingPush, send: Any, reason: str) -> None:
        """Resolve ``push`` DROPPED with ``reason`` and report the failed transfer."""
        verdict = Verdict.dropped(reason)
        report = control_pb2.TransferReport(
            update_id=push.update_id,
            src_host=self.host,
            dst_host=send.next_hop_host,
            bytes=push.payload_bytes,
            ok=False,
            error=reason,
            outcome=verdict.outcome,
            reason=reason,
        )
        taken = self.outgoing.take(push.update_id)
        if taken is not None:
            self.finish(taken, verdict)
        self._report(report)

    def _transfer(self, push: PendingPush, send: Any) -> None:
        header = FrameHeader(
            kind=_UPDATE,
            update_id=push.update_id,
            job=push.job,
            server=push.server,
            worker=push.worker,
            base_version=push.base_version,
            norm=push.norm,
            num_updates=1,
            tensors=layouts_to_pb(push.layouts),
            src_host=self.host,
            aggregate_id=send.aggregate_id,
        )
        report = control_pb2.TransferReport(
            update_id=push.update_id,
            src_host=self.host,
            dst_host=send.next_hop_host,
            bytes=push.payload_bytes,
        )
        # to an aggregator a member that may have arrived goes again (it is summed once); to a
        # server it never does: the push resolves UNKNOWN (the maybe-sent rule, in deliver())
        delivery = self._pool.deliver(
            send.next_hop_address,
            header,
            FileSpan(push.fd, 0, push.payload_bytes),
            crc32=push.crc32,
            may_resend=bool(send.aggregate_id),
        )
        reply, maybe_sent = delivery.reply, delivery.maybe_sent
        received = refused = False
        if reply is not None:
            h = reply.header
            received = h.kind == _ACK
            # an aggregator's ACK saying DROPPED: it refused the member (e.g. NaN or inf), unsummed
            refused = bool(send.aggregate_id) and received and h.outcome == _DROPPED
            if received:
                verdict = Verdict(h.outcome or _DROPPED, h.delay, h.version, h.reason)
            else:
                reason = f"daemon of host {send.next_hop_host!r} refused {push.update_id}: {h.reason}"
                verdict = Verdict.dropped(reason, h.version)
            report.start, report.end, report.throughput = reply.timing()
            report.ok = True
        else:  # no reply: certainly not applied (DROPPED), or maybe (UNKNOWN)
            if maybe_sent:
                verdict = Verdict.unknown(delivery.unknown_reason(push.update_id, send.next_hop_host))
            else:
                verdict = Verdict.dropped(
                    delivery.failed_reason(f"transfer of {push.update_id}", send.next_hop_host)
                )
            report.ok, report.error = False, verdict.reason
        if send.aggregate_id and not refused:  # unresolved until a ResolveDirective or a new send
            with self._lock:
                if received:
                    self._summed[push.update_id] = (send.aggregate_id, send.next_hop_host)
                else:
                    self._summed.pop(push.update_id, None)
            self._hold_for_aggregate(push, report, verdict, received, received or delivery.maybe_arrived)
            return
        unanswered = maybe_sent or not received or verdict.outcome == control_pb2.OUTCOME_UNKNOWN
        if unanswered and self._failed_over(push, send.next_hop_host, report, verdict):
            return  # announced again: it goes to the promoted replica
        report.outcome, report.delay, report.server_version = verdict.outcome, verdict.delay, verdict.version
        report.reason = verdict.reason
        taken = self.outgoing.take(push.update_id)
        if taken is not None:
            self.finish(taken, verdict)
        self._report(report)

    def _hold_for_aggregate(
        self, push: PendingPush, report: Any, verdict: Verdict, received: bool, maybe_summed: bool
    ) -> None:
        """After a send to an aggregator: keep the payload, report the transfer without an outcome.

        An ACK (``received``) means the aggregator summed the update: ``ok`` and no outcome. An
        ERROR (unknown or abandoned aggregate, not a member) or an unreachable aggregator reports
        ``ok=False`` naming the problem. Either way the push waits, its payload kept, for a
        ``ResolveDirective`` (the aggregate's verdict) or a new ``SendDirective`` — or the push
        deadline (:meth:`expired`; ``maybe_summed``: an attempt may have been summed unanswered).
        """
        if not received:
            report.ok, report.error = False, verdict.reason
        self.outgoing.hold(push.update_id, self._ctx.clock(), maybe_summed)
        self._report(report)
        if push.session != self.session and self._on_stale_hold is not None:
            self._on_stale_hold(push)  # held past the re-registration that would have let it go

    def unhold(self, job: str, worker: str) -> list[Any]:
        """Make the held pushes of a worker ready again; their ``UpdateReady`` messages (a new session).

        A push held after a send to an aggregator waits for a directive from the session that
        planned the aggregate; a new session never planned it. A push the aggregator refused
        (never summed) is announced again. A push it summed resolves UNKNOWN naming the
        aggregate: the aggregate may have reached the server, and a re-send could be applied
        again (the server's daemon remembers members' verdicts only while it and its server
        process run).
        """
        return [m for m in map(self._unheld, self.outgoing.unhold(job, worker)) if m is not None]

    def new_session(self) -> None:
        """A scheduler session was welcomed: pushes sent under the last one belong to no session."""
        self.session += 1

    def unhold_one(self, update_id: str) -> Any:
        """:meth:`unhold` for one push, if it is still held; its ``UpdateReady``, or None."""
        push = self.outgoing.unhold_one(update_id)
        return None if push is None else self._unheld(push)

    def _unheld(self, push: PendingPush) -> Any:
        """A push made ready again: UNKNOWN if its aggregator summed it, else its ``UpdateReady``."""
        with self._lock:
            summed = self._summed.pop(push.update_id, None)
        if summed is None:
            return update_ready(push)
        taken = self.outgoing.take(push.update_id)
        if taken is not None:
            why = "the scheduler session that planned it ended before its verdict"
            self.finish(taken, self._summed_verdict(push.update_id, summed, why))
        return None

    @staticmethod
    def _summed_verdict(update_id: str, summed: tuple[str, str], why: str) -> Verdict:
        """UNKNOWN for a push its aggregator summed: the aggregate may still reach the server."""
        return Verdict.unknown(
            f"{update_id} was summed into aggregate {summed[0]} at host {summed[1]!r}; {why}, "
            "so whether it reached the server cannot be known"
        )

    def expired(self, push: PendingPush, timeout: float, scheduler: str) -> Verdict:
        """The verdict on a push taken past the push deadline (:meth:`OutgoingPushes.take_expired`).

        READY: DROPPED, no directive came. HELD: its verdict was lost on its way (the
        aggregator, the scheduler and their messages), so UNKNOWN if its aggregator summed it
        or may have (the aggregate may still reach the server), DROPPED only if it certainly
        never reached one. The reason names the deadline either way.

        Examples
        --------
        >>> sender = PushSender(RoleContext("h1"), None, OutgoingPushes("h1"), print, None)
        >>> push = PendingPush("h1/1", "j", "ps0", "w0", -1, [], 0, 0.0, 0, 0.0, 1, None)
        >>> sender.expired(push, 60, "s:7077").reason
        'push deadline: h1/1 got no directive from the scheduler at s:7077 within 60 s'
        >>> push.state, push.maybe_summed = PushState.HELD, True
        >>> v = sender.expired(push, 60, "s:7077"); v.outcome == control_pb2.OUTCOME_UNKNOWN
        True
        """
        if push.state is not PushState.HELD:
            return Verdict.dropped(
                f"push deadline: {push.update_id} got no directive from the scheduler at {scheduler} "
                f"within {timeout:g} s"
            )
        why = (
            f"push deadline: no verdict and no new send directive from the scheduler at {scheduler} "
            f"within {timeout:g} s of it being held"
        )
        with self._lock:
            summed = self._summed.get(push.update_id)
        if summed is not None:
            return self._summed_verdict(push.update_id, summed, why)
        if push.maybe_summed:
            return Verdict.unknown(
                f"{push.update_id} may have been summed by an aggregator (a frame got no answer); "
                f"{why}, so whether it reached the server cannot be known"
            )
        return Verdict.dropped(
            f"{push.update_id} never reached an aggregator (refused or unreachable); {why}"
        )

    def shut_down(self, pushes: list[PendingPush], reason: str) -> None:
        """Resolve every push left at shutdown: DROPPED (never sent), UNKNOWN if its aggregator summed it."""
        for push in pushes:
            with self._lock:
                summed = self._summed.get(push.update_id)
            if summed is not None:
                self.finish(
                    push, self._summed_verdict(push.update_id, summed, f"{reason} before its verdict")
                )
            else:
                self.finish(push, Verdict.dropped(reason))

    def resolve(self, directive: Any) -> bool:
        """A ``ResolveDirective``: resolve a held push with the scheduler's verdict; False if unknown."""
        push = self.outgoing.take(directive.update_id)
        if push is None:
            _LOG.warning("resolve directive for unknown update %r", directive.update_id)
            return False
        verdict = Verdict(
            directive.outcome or _DROPPED, directive.delay, directive.server_version, directive.reason
        )
        self.finish(push, verdict)
        return True

    def _failed_over(self, push: PendingPush, host: str, report: Any, verdict: Verdict) -> bool:
        """The transfer of ``push`` to ``host`` got no verdict: announce it again if its server failed over.

        Only for a server that has a replica (or already failed over from ``host``): wait up to
        :data:`FAILOVER_WAIT` s for the ``JobUpdate`` naming the promoted replica, then report
        the failed transfer (no outcome: not resolved) and announce the update again; the
        scheduler sends it to the promoted replica, whose daemon answers from memory an update
        it already applied (replicated from the server) and applies one it lacks — which the
        surviving model then holds exactly once. False (resolve as before) when the server did
        not fail over (docs/replication.md).
        """
        if self._reannounce is None:
            return False
        loc = self._directory.wait_for_failover(
            push.job, push.server, host, FAILOVER_WAIT, self._ctx.stopping
        )
        if loc is None:
            return False
        failed = control_pb2.TransferReport()
        failed.CopyFrom(report)
        failed.ok, failed.error = False, report.error or verdict.reason  # no outcome: not resolved
        self._report(failed)
        if self.outgoing.requeue(push.update_id) is None:
            return True  # resolved meanwhile (e.g. the daemon stopping)
        _LOG.warning(
            "%s: server %r failed over from %r to %r; announced again",
            push.update_id,
            push.server,
            host,
            loc.host,
        )
        self._reannounce(
            push, f"server {push.server!r} failed over; the scheduler is away: {push.update_id} not sent"
        )
        return True
