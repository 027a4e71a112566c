"""The aggregator role of a daemon: summing members into an aggregate and forwarding it (paper §5).

An aggregator hop (MLfabric §5, Fig. 6) receives the updates of several workers, sums them and
sends one update's worth of bytes on to the server. The scheduler plans it; this daemon runs it:

1. ``AggregateDirective`` (aggregate id, job, server, members, where the server lives, a
   timeout): the daemon expects the listed members. A directive again with the same id
   replaces the member list (the scheduler removes members that were dropped or lost their
   source); one without members cancels the aggregate.
2. Each member arrives as an UPDATE frame whose header names the aggregate
   (``aggregate_id``); it is summed at once into the aggregate's pooled buffer
   (:class:`~mlfabric.aggregators.kernels.Accumulator`) and ACKed with no outcome (received).
   A retried member is ACKed again and not summed twice. A frame for an unknown, abandoned or
   finished aggregate, or from an update that is not a member, gets an ERROR naming it.
3. When every listed member is in, the daemon announces the aggregate with ``UpdateReady``
   (update id = aggregate id, one update's bytes, ``norm`` the sum of the members' norms,
   ``base_version`` the oldest member's: an aggregate's delay is its oldest member's).
4. ``SendDirective`` for the aggregate id: one UPDATE frame carrying the sum, its members and
   ``num_updates = len(members)`` goes to the server's daemon; the ACK's verdict, with each
   member's verdict, goes to the scheduler as the ``TransferReport``; the buffer is released.
   With ``dst_aggregate_id`` in the directive (a multi-level tree) the sum goes instead into
   that aggregate at another daemon, as one of its members (:mod:`.aggregate_tree`: the frame
   names every worker update it carries; a parent sums disjoint members only).
5. Members still missing ``timeout_seconds`` after the directive, a server that cannot be
   reached, or a re-issued directive that would remove a member already summed: the partial
   sum is discarded and ``AggregateFailed`` tells the scheduler, which re-plans the members
   (their sources still hold the payloads). A forward whose frame may have reached the server's
   daemon (it went away before answering) is never resent: the report says UNKNOWN, for the
   aggregate and each member.
6. ``AggregateDirective.pipelined`` (docs/pipelined-aggregation.md): raw float32 members are
   summed as they land (:mod:`.pipelined`, :mod:`.stream`), the aggregate is announced once
   every member has begun, a send directive that comes earlier waits for that, and the
   forward sends each piece of the sum once every member delivered it; a member that breaks
   off fails the aggregate and cuts its forward off before the CRC trailer.

All state is in memory; the scheduler stream ending abandons every aggregate.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from mlfabric.aggregators.codecs.payloadsum import EncodedSum
from mlfabric.daemon.channels.frames import (
    FileSpan,
    Frame,
    PayloadWatch,
    error_header,
    non_finite_reason,
)
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.payloadio import PayloadAborted, StreamedPayload
from mlfabric.daemon.channels.peers import Delivery
from mlfabric.daemon.channels.routing import FrameRoute
from mlfabric.daemon.roles.aggregator import pipelined, summing
from mlfabric.daemon.roles.aggregator import tree as aggregate_tree
from mlfabric.daemon.roles.aggregator.state import Aggregate
from mlfabric.daemon.roles.base import Role, RoleContext, Routes
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

__all__ = ["AggregatorRole"]

_LOG = logging.getLogger("mlfabric.daemon")
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_ACK = dataplane_pb2.FRAME_KIND_ACK
_DROPPED = control_pb2.OUTCOME_DROPPED

#: Seconds an aggregate may wait for its members when its directive gives no timeout.
DEFAULT_TIMEOUT = 60.0


class AggregatorRole(Role):
    """The aggregates a daemon runs as an aggregator hop (thread-safe). :meth:`start`, :meth:`stop`.

    Parameters
    ----------
    context : RoleContext
        This daemon's host name, its task pool (forwards), its clock.
    alloc : callable
        ``alloc(nbytes)`` -> a writable buffer with ``release()`` (the daemon's ``MemfdPool``).
    announce : callable
        ``announce(UpdateReady) -> bool`` sends it to the scheduler (False: not connected).
    failed : callable
        ``failed(AggregateFailed)`` sends it to the scheduler.
    report : callable
        ``report(TransferReport)`` sends it to the scheduler (and the report log).
    deliver : callable
        ``deliver(address, header, payload) -> Delivery``: one frame to a peer daemon, retried
        while the peer certainly got nothing (:meth:`~mlfabric.daemon.channels.peers.PeerPool.deliver`).
    early_wait : float
        Seconds a member frame waits for its aggregate's directive (the directive and the
        source's send directive travel on different streams and may arrive in either order).
    enabled : bool
        False (``--no-aggregator``): every directive is answered with ``AggregateFailed``.

    Examples
    --------
    >>> role = AggregatorRole(RoleContext("a0"), bytearray, lambda m: True, print, print, None)
    >>> role.owns("agg:x:0")
    False
    """

    def __init__(
        self,
        context: RoleContext,
        alloc: Callable[[int], Any],
        announce: Callable[[Any], bool],
        failed: Callable[[Any], Any],
        report: Callable[[Any], Any],
        deliver: Callable[[str, Any, Any], Delivery] | None,
        *,
        early_wait: float = 5.0,
        remember: int = 10_000,
        enabled: bool = True,
    ) -> None:
        self.host = context.host
        self._submit = context.submit
        self._alloc = alloc
        self._announce = announce
        self._failed = failed
        self._report = report
        self._deliver = deliver
        self._clock = context.clock
        self._early_wait = early_wait
        self._remember = remember
        self.enabled = enabled
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._aggregates: dict[str, Aggregate] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why
        self._stopping = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._pipelines = False  # a pipelined aggregate was directed here: members are watched

    def routes(self) -> Routes:
        return Routes(
            frames={FrameRoute.AGGREGATE_MEMBER: self.on_frame},
            watches={FrameRoute.AGGREGATE_MEMBER: self.watch_member},
            directives={
                "aggregate": self.on_directive,
                "send_aggregate": lambda send: self._submit(self.forward, send),  # sends: not inline
                "drop_aggregate": lambda drop: self.drop(drop.update_id, drop.reason),
            },
        )

    def scheduler_lost(self, reason: str) -> None:
        """Abandon every aggregate (the scheduler forgets them too)."""
        self.abandon_all(f"scheduler connection lost: {reason}")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the thread that fails aggregates whose members are late."""
        self._stopping.clear()
        self._sweeper = threading.Thread(target=self._sweep, name=f"aggregator-{self.host}", daemon=True)
        self._sweeper.start()

    def stop(self) -> None:
        """Abandon every aggregate (no messages: the daemon is going) and stop the sweeper."""
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        if self._sweeper is not None:
            self._sweeper.join(5)
        self.abandon_all(f"daemon of host {self.host!r} shut down", notify=False)

    def _sweep(self) -> None:
        while not self._stopping.wait(0.1):
            self.expire(self._clock())

    # ------------------------------------------------------------------ directives

    def owns(self, aggregate_id: str) -> bool:
        """Whether this daemon runs aggregate ``aggregate_id`` (so a send or drop is for it)."""
        with self._lock:
            return aggregate_id in self._aggregates

    def on_directive(self, directive: Any) -> None:
        """An ``AggregateDirective``: expect its members, or replace the member list of a known one."""
        d = directive
        if not self.enabled:
            reason = f"host {self.host!r} does not aggregate (its daemon runs with --no-aggregator)"
            self._failed(control_pb2.AggregateFailed(aggregate_id=d.aggregate_id, reason=reason))
            return
        members = {m.update_id: m for m in d.members}
        timeout = d.timeout_seconds if d.timeout_seconds > 0 else DEFAULT_TIMEOUT
        with self._lock:
            agg = self._aggregates.get(d.aggregate_id)
            if agg is None:
                if not members:
                    return
                self._aggregates[d.aggregate_id] = Aggregate(
                    d.aggregate_id,
                    d.job,
                    d.server,
                    d.dst_host,
                    d.dst_address,
                    members,
                    self._clock() + timeout,
                    allow_non_finite=d.allow_non_finite,
                    dst_aggregate_id=d.dst_aggregate_id,
                    pipelined=d.pipelined,
                )
                self._pipelines = self._pipelines or d.pipelined
                self._gone.pop(d.aggregate_id, None)
                self._changed.notify_all()
                return
        ready = None
        with agg.lock:
            if agg.stream is not None and members and set(members) != set(agg.members):
                # members still to come may join or leave until the first piece of the sum is made
                begun = [m for m in agg.members if m not in members and agg.stream.begun(m)]
                if begun or agg.state == "forwarding" or not agg.stream.relist(members):
                    why = f"without {begun}, which began to arrive" if begun else "once its sum had begun"
                    self._abandon(agg, f"aggregate {agg.aggregate_id} re-issued {why}", notify=True)
                    return
            if agg.state == "ready" and members and set(members) > set(agg.members):
                agg.state = "collecting"  # a member joins before the aggregate leaves: open again
            if agg.state != "collecting":
                if agg.state == "ready" and set(members) == set(agg.members):
                    return  # the same list again: nothing changes
                problem = f"re-issued while {agg.state}"
            elif not members:
                self._abandon(agg, "cancelled by the scheduler (no members left)", notify=False)
                return
            else:
                summed = [m for m in agg.arrived if m not in members]
                problem = f"re-issued without member(s) {summed} already summed" if summed else ""
                if not problem:
                    agg.members = members
                    agg.allow_non_finite = d.allow_non_finite
                    agg.dst_aggregate_id = d.dst_aggregate_id
                    agg.deadline = self._clock() + timeout
                    agg.dst_host, agg.dst_address = (
                        d.dst_host or agg.dst_host,
                        d.dst_address or agg.dst_address,
                    )
                    ready = self._complete_if_in(agg)
                    self._changed_notify()
            if problem:
                self._abandon(agg, f"aggregate {agg.aggregate_id} {problem}", notify=True)
                return
        if ready is not None:
            self._announce_ready(ready)

    def drop(self, aggregate_id: str, reason: str) -> bool:
        """A ``DropDirective`` for an aggregate: discard it (no report). False if unknown."""
        with self._lock:
            agg = self._aggregates.get(aggregate_id)
        if agg is None:
            return False
        with agg.lock:
            self._abandon(agg, f"dropped by the scheduler: {reason}", notify=False)
        return True

    def abandon_all(self, reason: str, *, notify: bool = False) -> None:
        """Discard every aggregate (the scheduler stream ended, or shutdown)."""
        with self._lock:
            aggregates = list(self._aggregates.values())
        for agg in aggregates:
            with agg.lock:
                self._abandon(agg, reason, notify=notify)

    def expire(self, now: float) -> None:
        """Fail every aggregate still missing members after its deadline."""
        with self._lock:
            late = [a for a in self._aggregates.values() if a.state == "collecting" and now >= a.deadline]
        for agg in late:
            with agg.lock:
                if agg.state == "collecting" and now >= agg.deadline:
                    self._abandon(
                        agg,
                        f"aggregate {agg.aggregate_id}: member(s) {agg.missing()} did not arrive "
                        f"within its timeout",
                        notify=True,
                    )

    def _abandon(self, agg: Aggregate, reason: str, *, notify: bool) -> None:
        """Discard ``agg`` (its lock held): release the buffer, remember why, tell the scheduler."""
        if agg.state == "abandoned":
            return
        if agg.stream is not None:
            agg.stream.abort(reason)  # a forward under way is cut off before its CRC trailer
        if agg.state == "forwarding":  # the forward releases the buffer when it ends
            agg.state = "abandoned"
        else:
            agg.state = "abandoned"
            self._release(agg)
        with self._lock:
            if self._aggregates.get(agg.aggregate_id) is agg:
                del self._aggregates[agg.aggregate_id]
            self._forget(agg.aggregate_id, reason)
        _LOG.info("aggregate %s abandoned: %s", agg.aggregate_id, reason)
        if notify:
            self._failed(
                control_pb2.AggregateFailed(aggregate_id=agg.aggregate_id, reason=reason, arrived=agg.arrived)
            )

    def _forget(self, aggregate_id: str, reason: str) -> None:
        self._gone[aggregate_id] = reason
        while len(self._gone) > self._remember:
            self._gone.popitem(last=False)

    @staticmethod
    def _release(agg: Aggregate) -> None:
        agg.acc = None
        if agg.stream is not None:  # its views first, then the frames and the buffer they view
            agg.stream.release()
            agg.stream.out.release()
        for frame in agg.frames:
            frame.release()
        agg.frames.clear()
        buffer, agg.buffer = agg.buffer, None
        if buffer is not None and hasattr(buffer, "release"):
            buffer.release()

    # ------------------------------------------------------------------ members

    def on_frame(self, frame: Frame) -> Response:
        """A member's UPDATE frame: sum it (pipelined: keep it for the stream), ACK it; or ERROR."""
        response, kept = self._on_member(frame)
        if not kept:
            frame.release()
        return response

    def _error(self, reason: str, update_id: str) -> Response:
        return Response(error_header(reason, update_id=update_id, src_host=self.host))

    def _changed_notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait_for(self, aggregate_id: str, member: str = "") -> tuple[Aggregate | None, str]:
        """The aggregate, once its directive (listing ``member``, if given) is in; or why not.

        A member joining an aggregate being gathered may arrive before the re-issued
        directive that lists it: it waits for it as for an unknown aggregate's directive.
        """
        deadline = self._clock() + self._early_wait
        with self._changed:
            while True:
                agg = self._aggregates.get(aggregate_id)
                listed = agg is not None and (not member or member in agg.members or agg.state == "abandoned")
                if agg is not None and (listed or deadline <= self._clock() or self._stopping.is_set()):
                    return agg, ""
                gone = self._gone.get(aggregate_id)
                if gone is not None:
                    return None, f"aggregate {aggregate_id} was abandoned on host {self.host!r}: {gone}"
                left = deadline - self._clock()
                if left <= 0 or self._stopping.is_set():
                    return None, f"aggregate {aggregate_id} is unknown on host {self.host!r}"
                self._changed.wait(min(left, 0.1))

    def watch_member(self, header: Any, payload: memoryview) -> PayloadWatch | None:
        """A member's frame starts landing: a watch feeding its pipelined aggregate's sum, or None.

        None: the frame is handled whole by :meth:`on_frame` (:func:`.pipelined.begin_member`
        says when). Once every member has begun, the aggregate is announced (``UpdateReady``).
        """
        if not self.enabled or not self._pipelines or not header.aggregate_id:
            return None  # (before any pipelined directive: the member is not held up waiting)
        agg, _ = self._wait_for(header.aggregate_id, header.update_id)
        if agg is None:
            return None
        with agg.lock:
            begun = pipelined.begin_member(agg, header, payload, self._alloc, self._clock)
            ready = self._complete_if_in(agg) if begun else None
        if ready is not None:
            self._announce_ready(ready)
        if begun is None:
            return None
        return pipelined.MemberWatch(agg, header.update_id, self._broke_off)

    def _broke_off(self, agg: Aggregate, member: str, reason: str) -> None:
        """A watched member's receive failed: its pipelined aggregate cannot be completed."""
        with agg.lock:
            why = f"member {member} of aggregate {agg.aggregate_id} broke off while it arrived: {reason}"
            self._abandon(agg, why, notify=True)

    def _on_member(self, frame: Frame) -> tuple[Response, bool]:
        """The reply to a member's frame, and whether its aggregate keeps the frame (a stream's)."""
        h = frame.header
        agg, problem = self._wait_for(h.aggregate_id, h.update_id)
        if agg is None:
            return self._error(problem, h.update_id), False
        if agg.stream is not None:
            return self._on_streamed(agg, frame)
        return self._on_stored(agg, frame), False

    def _on_streamed(self, agg: Aggregate, frame: Frame) -> tuple[Response, bool]:
        """A pipelined aggregate's member arrived whole: accepted into the stream (its frame kept)."""
        h = frame.header
        with agg.lock:
            if agg.state == "abandoned":
                why = f"aggregate {h.aggregate_id} was abandoned on host {self.host!r}"
                return self._error(why, h.update_id), False
            if h.update_id in agg.arrived:
                return self._ack(h, frame), False  # a retry: summed once already
            if h.update_id in agg.refused:
                return self._ack(h, frame, agg.refused[h.update_id]), False  # refused already
            problem, refused = pipelined.accept_member(agg, frame, f"aggregator {self.host!r}")
            if problem or refused:  # the sum holds some of its bytes: the aggregate fails
                self._abandon(agg, problem or refused, notify=True)
            if problem:
                return self._error(problem, h.update_id), False
        return self._ack(h, frame, refused), not refused

    def _on_stored(self, agg: Aggregate, frame: Frame) -> Response:
        """A store-and-forward aggregate's member: summed into its accumulator now."""
        h = frame.header
        ready = None
        with agg.lock:
            if agg.state == "abandoned":
                return self._error(
                    f"aggregate {h.aggregate_id} was abandoned on host {self.host!r}", h.update_id
                )
            if h.update_id in agg.arrived:
                return self._ack(h, frame)  # a retry: summed once already
            if h.update_id in agg.refused:
                return self._ack(h, frame, agg.refused[h.update_id])  # a retry: refused already
            if h.update_id not in agg.members or agg.state != "collecting":
                return self._error(
                    f"update {h.update_id} is not a member of aggregate {h.aggregate_id} "
                    f"(members: {sorted(agg.members)})",
                    h.update_id,
                )
            if (h.job, h.server) != (agg.job, agg.server):
                return self._error(
                    f"update {h.update_id} is for server {h.server!r} of job {h.job!r}, aggregate "
                    f"{h.aggregate_id} for server {agg.server!r} of job {agg.job!r}",
                    h.update_id,
                )
            brings = aggregate_tree.carried(h, agg.members[h.update_id])
            twice = aggregate_tree.overlap(h.update_id, brings, agg.members, agg.summed)
            if twice:  # summing it would count these worker updates twice
                return self._error(
                    f"update {h.update_id} carries worker update(s) {twice} that aggregate "
                    f"{h.aggregate_id} already carries or expects; not summed",
                    h.update_id,
                )
            if frame.non_finite is not None and not agg.allow_non_finite:
                # found in the CRC pass: refused before it is summed; its source resolves the push
                # DROPPED and the scheduler re-issues the aggregate without it
                refused_by = f"aggregator {self.host!r} (aggregate {h.aggregate_id})"
                agg.refused[h.update_id] = non_finite_reason(frame.non_finite, h.update_id, refused_by)
                return self._ack(h, frame, agg.refused[h.update_id])
            problem = summing.add_member(agg, h, frame, self._alloc)
            if problem:
                return self._error(f"update {h.update_id}: cannot be summed: {problem}", h.update_id)
            agg.arrived.append(h.update_id)
            agg.summed[h.update_id] = brings
            ready = self._complete_if_in(agg)
        if ready is not None:
            self._announce_ready(ready)
        return self._ack(h, frame)

    def _ack(self, h: Any, frame: Frame, refused: str = "") -> Response:
        """ACK a member: received (no outcome), or ``refused`` (DROPPED with that reason, not summed)."""
        return Response(aggregate_tree.member_ack(h, self.host, frame.stats.seconds, refused))

    def _complete_if_in(self, agg: Aggregate) -> Any:
        """With ``agg.lock`` held: if every member is in (begun, pipelined), the UpdateReady to send."""
        if agg.state != "collecting":
            return None
        if agg.stream is not None:
            if not all(agg.stream.begun(m) for m in agg.members):
                return None
        elif agg.missing() or agg.acc is None:
            return None
        agg.state = "ready"  # summed by forward(): a member may still join (re-issued directive)
        h = agg.header(self.host)
        return control_pb2.UpdateReady(
            update_id=agg.aggregate_id,
            job=agg.job,
            server=agg.server,
            worker="",
            bytes=agg.payload_bytes,
            norm=h.norm,
            base_version=h.base_version,
            ready_at=self._clock(),
            codec=agg.acc.codec if isinstance(agg.acc, EncodedSum) else "",
            members=list(agg.members) if agg.stream is not None else [],
        )

    def _announce_ready(self, ready: Any) -> None:
        announced = self._announce(ready)
        with self._lock:
            agg = self._aggregates.get(ready.update_id)
        if agg is None:
            return
        with agg.lock:
            if not announced:
                self._abandon(agg, "scheduler not connected when the aggregate was complete", notify=False)
            send, agg.pending_send = agg.pending_send, None
        if send is not None and announced:
            self._submit(self.forward, send)  # directed before its members began: it goes now

    # ------------------------------------------------------------------ forwarding

    def forward(self, send: Any) -> None:
        """A ``SendDirective`` for a ready aggregate: send it to the server, report, release it."""
        with self._lock:
            agg = self._aggregates.get(send.update_id)
            gone = self._gone.get(send.update_id, "never directed to this daemon")
        if agg is None:
            if gone.startswith("forwarded to "):
                return  # a repeated directive: the forward reported already
            self._cannot_forward(send, f"this daemon does not hold it ({gone})")
            return
        with agg.lock:
            if agg.state == "forwarding":
                return  # a repeated directive: the forward under way reports
            if agg.pipelined and agg.state == "collecting":
                agg.pending_send = send  # released with its members: it goes once they have begun
                return
            if agg.state != "ready":
                state = agg.state
                self._abandon(agg, f"send directive while {state}", notify=False)
                self._cannot_forward(send, f"it is {state}, not complete")
                return
            problem = summing.finish(agg, self._alloc) if agg.stream is None else ""
            if problem:
                self._abandon(
                    agg, f"aggregate {agg.aggregate_id} cannot be forwarded: {problem}", notify=True
                )
                self._cannot_forward(send, problem)
                return
            agg.state = "forwarding"
            header = agg.header(self.host)
        address = send.next_hop_address or agg.dst_address
        parent = send.aggregate_id if send.aggregate_id and send.aggregate_id != agg.aggregate_id else ""
        parent = parent or agg.dst_aggregate_id
        if parent:  # into the parent aggregate the scheduler named (it may differ from the directive's)
            header.aggregate_id = parent
        report = control_pb2.TransferReport(
            update_id=agg.aggregate_id,
            src_host=self.host,
            dst_host=send.next_hop_host,
            bytes=agg.payload_bytes,
        )
        payload: Any = b""
        if agg.stream is not None:
            stream, deadline = agg.stream, agg.deadline
            payload = StreamedPayload(stream.out, lambda upto: stream.wait(upto, deadline))
        elif agg.payload_bytes and getattr(agg.buffer, "fd", -1) >= 0:
            payload = FileSpan(agg.buffer.fd, 0, agg.payload_bytes)  # sendfile from the pooled memfd
        elif agg.payload_bytes:
            payload = memoryview(agg.buffer)[: agg.payload_bytes]
        cut = ""
        try:
            assert self._deliver is not None
            delivery = self._deliver(address, header, payload)  # never resent once it may have arrived
        except PayloadAborted as exc:  # cut off before its CRC trailer: its receiver discarded it
            cut = (
                f"the pipelined forward of aggregate {agg.aggregate_id} was cut off (nothing applied): {exc}"
            )
        finally:
            if isinstance(payload, memoryview):
                payload.release()
        if cut:
            report.ok, report.error = False, cut
            failure = cut
        else:
            failure = aggregate_tree.fill_forward_report(report, delivery, header.members, parent)
        with agg.lock:
            agg.state = "abandoned"
            self._release(agg)
            with self._lock:
                if self._aggregates.get(agg.aggregate_id) is agg:
                    del self._aggregates[agg.aggregate_id]
                self._forget(agg.aggregate_id, failure or f"forwarded to {parent or 'the server'}")
        self._report(report)
        if failure:
            self._failed(
                control_pb2.AggregateFailed(
                    aggregate_id=agg.aggregate_id, reason=failure, arrived=agg.arrived
                )
            )

    def _cannot_forward(self, send: Any, why: str) -> None:
        """Report that the aggregate of ``send`` never left this daemon (its members are re-planned)."""
        error = f"cannot forward aggregate {send.update_id!r}: {why}"
        _LOG.warning("%s", error)
        report = control_pb2.TransferReport(
            update_id=send.update_id, src_host=self.host, dst_host=send.next_hop_host, ok=False, error=error
        )
        self._report(report)
