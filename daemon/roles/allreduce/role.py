"""The all-reduce role of a daemon: summing up a tree or around a ring, and back (docs/allreduce.md).

A local process calls ``allreduce`` (``AllreduceRequest``, its contribution in a memfd). The
daemon checks the tensors, keeps the memfd, and tells the scheduler ``AllreduceReady``. Once
every participant is in and they agree, the scheduler sends each participant's daemon an
``AllreduceDirective``: its parent and children in the tree and the chunk size. Then, chunk by
chunk (pipelined; for a ring every segment of the payload is such a chain along the ring,
:mod:`~mlfabric.daemon.roles.allreduce.routes`, so each chunk has its own children and parent):

- **reduce**: a participant sums (:class:`~mlfabric.aggregators.kernels.Accumulator`) each
  child's partial sum into its own chunk, in place in its process's memfd, and sends the chunk
  to its parent. A leaf's partial sum is its own contribution, sent from that memfd. Each
  partial sum names the participants it holds: a repeated frame is ACKed and not summed again,
  and a frame whose participants overlap what the chunk already holds is refused, so nothing is
  counted twice; the root checks that every chunk holds all ``world_size`` participants.
- **broadcast**: the root's finished chunks, and every chunk received from the parent, go to
  the children, and overwrite the chunk in the memfd. Once every chunk of the result is in
  and forwarded, the memfd (the process's own, now holding the sum: no memory of the daemon's
  per operation) goes back to the local process (``AllreduceResult``) and ``AllreduceDone``
  to the scheduler.

Failures never hang: a peer that cannot be reached, a refused frame, the local process
disconnecting, the scheduler stream breaking, or the participant's deadline passing fail the
operation here (a ``LocalError`` to the process, ``AllreduceDone{ok=false}`` to the scheduler,
which aborts it at every other participant with ``AllreduceAbort``).

Operations a process group runs (``plan_only``) only have their plans carried here
(:mod:`~mlfabric.daemon.roles.allreduce.group`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

from mlfabric.aggregators.kernels import Accumulator
from mlfabric.daemon.channels.frames import FileSpan, Frame, FrameHeader, error_header
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.channels.peers import PeerUnavailable
from mlfabric.daemon.channels.routing import FrameRoute
from mlfabric.daemon.roles.allreduce.group import GroupPlans
from mlfabric.daemon.roles.allreduce.op import AllreduceError, Key, Op, Sender, check_request, ready_message
from mlfabric.daemon.roles.allreduce.routes import routing
from mlfabric.daemon.roles.base import Role, RoleContext, Routes
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.wire import _native
from mlfabric.wire.tensors import layouts_from_pb, layouts_to_pb

__all__ = ["DEFAULT_TIMEOUT", "AllreduceRole"]

_LOG = logging.getLogger("mlfabric.daemon")
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_ACK = dataplane_pb2.FRAME_KIND_ACK
REDUCE, BROADCAST = 1, 2
#: Seconds a participant waits for the result when its request gives no timeout.
DEFAULT_TIMEOUT = 60.0
#: Seconds a chunk that arrives before its operation's directive waits for it.
EARLY_WAIT = 10.0
#: The process's memfd, mapped shared with its pages mapped in at once.
_SHARED_POPULATE = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class AllreduceRole(Role):
    """The all-reduces of this daemon's processes (thread-safe). :meth:`stop` fails what is left.

    Parameters
    ----------
    context : RoleContext
        This daemon's host, the scheduler session (``send``: False when not connected), the clock.
    request : callable
        ``request(address, header, payload) -> Reply``: one frame to a peer daemon
        (:meth:`~mlfabric.daemon.channels.peers.PeerPool.request`); raises ``PeerUnavailable``.
    """

    def __init__(self, context: RoleContext, request: Callable[..., Any]) -> None:
        self.host = context.host
        self._control = context.send
        self._request = request
        self._clock = context.clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ops: dict[Key, Op] = {}
        #: recently finished or failed operations: key -> why (a late frame is refused at once)
        self._gone: collections.OrderedDict[Key, str] = collections.OrderedDict()
        self._stopping = threading.Event()
        #: the plan requests of process-group participants
        self.group = GroupPlans(self._control, self._clock)

    def routes(self) -> Routes:
        return Routes(
            requests={"allreduce": self.on_request},
            frames={FrameRoute.ALLREDUCE_CHUNK: self.on_frame},
            directives={"allreduce": self.on_directive, "allreduce_abort": self.on_abort},
        )

    # ------------------------------------------------------------------ local API

    def on_request(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """A local ``AllreduceRequest``: check it, keep the memfd, announce it. Returns an fd to close."""
        req, rid = request.allreduce, request.request_id
        key: Key = (req.job, req.name, int(req.seq), req.participant)
        problem = check_request(req, fd)
        if problem is not None:
            conn.error(rid, *problem)
            return fd
        timeout = req.timeout_seconds if req.timeout_seconds > 0 else DEFAULT_TIMEOUT
        if req.plan_only:
            self.group.request(conn, req, rid, timeout=timeout)
            return fd
        assert fd is not None
        size = req.payload_bytes
        try:  # the sums and the result go in place: its pages exist already (no zeroing, no faults)
            data = mmap.mmap(fd, size, _SHARED_POPULATE) if size else mmap.mmap(-1, 1)
        except OSError as exc:  # e.g. a read-only or sealed memfd
            conn.error(rid, "bad_request", f"the all-reduce's memfd cannot be mapped for writing: {exc}")
            return fd
        now = self._clock()
        op = Op(key, conn, rid, fd, data, list(req.tensors), size, req.world_size, now + timeout, now)
        with self._lock:
            if key in self._ops:
                taken = True
            else:
                taken = False
                self._ops[key] = op
                self._gone.pop(key, None)
        if taken:
            self._close(op)
            conn.error(rid, "bad_request", f"{op.name()} is already in progress on host {self.host!r}")
            return None
        ready = ready_message(req, size, timeout)
        if not self._control(control_pb2.DaemonMessage(allreduce_ready=ready)):
            self.fail(key, "unavailable", f"{op.name()}: the scheduler is not connected", tell=False)
        return None

    def connection_closed(self, conn: LocalConnection) -> None:
        """The process of ``conn`` went away: its operations fail (the others are told)."""
        self.group.connection_closed(conn)
        with self._lock:
            keys = [k for k, op in self._ops.items() if op.conn is conn]
        for key in keys:
            self.fail(
                key, "allreduce_peer_lost", f"participant {key[3]!r}'s process disconnected from its daemon"
            )

    # ------------------------------------------------------------------ directives

    def on_directive(self, d: Any) -> None:
        """``AllreduceDirective``: this participant's place in the tree or ring; start moving chunks."""
        if d.executor_kind:  # a process group runs it: the plan goes to the process
            self.group.directive(d)
            return
        key: Key = (d.job, d.name, int(d.seq), d.participant)
        with self._lock:
            op = self._ops.get(key)
        if op is None:
            _LOG.info("all-reduce directive for %s, which is not (or no longer) here", key)
            return
        with op.lock:
            if op.state != "waiting":
                return
            problem: str | None = None
            try:
                r = routing(d, layouts_from_pb(op.tensors), op.payload_bytes)
            except ValueError as exc:
                problem = f"{op.name()}: bad plan: {exc}"
            else:
                op.directive = d
                op.chunks, op.segment_of, op.routes = r.chunks, r.segment_of, r.routes
                n = len(op.chunks)
                op.summed = [{d.participant} for _ in range(n)]
                op.have = [False] * n
                op.forwarded = [0] * n
                op.state = "planned"
                op.senders = {p: Sender(self.send_chunk, op, peer) for p, peer in r.peers.items()}
        if problem is not None:
            self.fail(key, "allreduce_failed", problem)
            return
        with self._changed:
            self._changed.notify_all()
        for c in op.chunks:  # where this participant is a leaf, its partial sum is its own chunk
            if not op.route(c.index).children:  # (and at the root of a world of one, the result)
                self._reduced(op, c.index)
        self._maybe_done(op)  # a payload with no chunks

    def on_abort(self, a: Any) -> None:
        """``AllreduceAbort``: fail every local participant of the operation with its reason."""
        self.group.abort(a)
        with self._lock:
            keys = [k for k in self._ops if k[:3] == (a.job, a.name, int(a.seq))]
        for key in keys:
            self.fail(key, a.code or "allreduce_failed", a.reason, tell=False)

    def scheduler_lost(self, reason: str) -> None:
        """The control stream broke: every operation fails (the scheduler forgets them too)."""
        self.group.scheduler_lost(reason)
        with self._lock:
            keys = list(self._ops)
        for key in keys:
            self.fail(key, "unavailable", f"scheduler connection lost: {reason}", tell=False)

    def tick(self) -> None:
        """Fail operations past their deadline."""
        self.group.tick()
        now = self._clock()
        with self._lock:
            late = [(k, op) for k, op in self._ops.items() if now > op.deadline]
        for key, op in late:
            with op.lock:
                where = "waiting for the other participants" if op.state == "waiting" else "in the tree"
                have = sum(op.have)
            self.fail(
                key,
                "allreduce_timeout",
                f"{op.name()}: no result within {op.deadline - op.started:g} s ({where}; "
                f"{have}/{len(op.chunks) or '?'} chunks of the result in)",
            )

    def stop(self) -> None:
        """Fail every operation (the daemon is stopping)."""
        self._stopping.set()
        self.group.stop(self.host)
        with self._lock:
            keys = list(self._ops)
        for key in keys:
            self.fail(key, "unavailable", f"daemon of host {self.host!r} shut down")

    # ------------------------------------------------------------------ chunks

    def _reduced(self, op: Op, index: int) -> None:
        """Chunk ``index``'s partial sum is complete here: up to the parent, or (root) down."""
        parent = op.route(index).parent
        if parent is not None:
            op.senders[parent.participant].queue.put((REDUCE, index))
        else:
            if len(op.summed[index]) != op.world_size:
                self.fail(
                    op.key,
                    "allreduce_failed",
                    f"{op.name()}: chunk {index} sums {len(op.summed[index])} participants, "
                    f"world size {op.world_size}",
                )
                return
            self._result_chunk(op, index)

    def _result_chunk(self, op: Op, index: int) -> None:
        """Chunk ``index`` of the result is here: forward it to the children; deliver when complete."""
        with op.lock:
            op.have[index] = True
            senders = [op.senders[peer.participant] for peer in op.route(index).forward]
        for s in senders:
            s.queue.put((BROADCAST, index))
        self._maybe_done(op)

    def _maybe_done(self, op: Op) -> None:
        with op.lock:
            if op.state != "planned" or not all(op.have):
                return
            if any(f < len(op.route(i).forward) for i, f in enumerate(op.forwarded)):
                return
            op.state = "done"
        result = local_pb2.AllreduceResult(
            name=op.key[1],
            seq=op.key[2],
            tensors=op.tensors,
            payload_bytes=op.payload_bytes,
            has_payload=True,
            plan=op.directive.plan,
        )
        op.conn.send(local_pb2.LocalEvent(request_id=op.request_id, allreduce_result=result), op.fd)
        seconds = self._clock() - op.started
        self._finish(op, "delivered")
        job, name, seq, participant = op.key
        done = control_pb2.AllreduceDone(
            job=job, name=name, seq=seq, participant=participant, ok=True, seconds=seconds
        )
        self._control(control_pb2.DaemonMessage(allreduce_done=done))

    def send_chunk(self, op: Op, peer: Any, phase: int, index: int) -> bool:
        """Send chunk ``index`` to ``peer`` (a sender thread); False once the operation failed."""
        with op.lock:
            if op.state != "planned":
                return False
            c = op.chunks[index]
            summed = sorted(op.summed[index]) if phase == REDUCE else []
            crc = op.crcs.get((phase, index))
            fd = os.dup(op.fd)  # this send's own: the operation may end (closing op.fd) meanwhile
        job, name, seq, participant = op.key
        header = FrameHeader(
            kind=_UPDATE,
            update_id=f"allreduce:{job}:{name}:{seq}:{participant}:{phase}:{index}",
            job=job,
            src_host=self.host,
            payload_bytes=c.hi - c.lo,
            tensors=layouts_to_pb(c.layouts),
            allreduce=dataplane_pb2.AllreduceChunk(
                job=job,
                name=name,
                seq=seq,
                to_participant=peer.participant,
                from_participant=participant,
                phase=phase,
                index=index,
                count=len(op.chunks),
                offset=c.lo,
                summed=summed,
            ),
        )
        try:
            if crc is None:  # a leaf's own chunk: read here once
                with memoryview(op.data)[c.lo : c.hi] as own:
                    crc = _native.crc32(own)
            # sendfile from the memfd: no copy into the socket. The bytes sent do not change until
            # the peer has them: a chunk is overwritten only by its result, which comes after every
            # contribution was received, and the operation ends only once every result was ACKed.
            span = FileSpan(fd, c.lo, c.hi - c.lo)
            reply = self._request(peer.data_address, header, span, crc32=crc)
        except (PeerUnavailable, OSError, ValueError) as exc:
            self.fail(
                op.key,
                "allreduce_peer_lost",
                f"{op.name()}: sending chunk {index} to participant {peer.participant!r} on host "
                f"{peer.host!r} failed: {exc}",
            )
            return False
        finally:
            os.close(fd)
        reply.release()
        if reply.header.kind != _ACK:
            self.fail(
                op.key,
                "allreduce_failed",
                f"{op.name()}: participant {peer.participant!r} on host {peer.host!r} refused chunk "
                f"{index}: {reply.header.reason}",
            )
            return False
        if phase == BROADCAST:
            with op.lock:
                op.forwarded[index] += 1
            self._maybe_done(op)
        return True

    def on_frame(self, frame: Frame) -> Response:
        """A chunk frame (``header.allreduce`` set): sum it or take it as the result; ACK or ERROR."""
        try:
            return self._on_chunk(frame)
        except AllreduceError as exc:
            return Response(error_header(str(exc), update_id=frame.header.update_id, src_host=self.host))
        finally:
            frame.release()

    def _wait_for(self, key: Key) -> Op:
        deadline = self._clock() + EARLY_WAIT
        with self._changed:
            while True:
                op = self._ops.get(key)
                if op is not None and op.state != "waiting":
                    return op
                gone = self._gone.get(key)
                if gone is not None:
                    raise AllreduceError("allreduce_failed", f"participant {key[3]!r} gave up: {gone}")
                left = deadline - self._clock()
                if left <= 0 or self._stopping.is_set():
                    raise AllreduceError(
                        "allreduce_failed",
                        f"all-reduce {key[1]!r}#{key[2]} of job {key[0]!r}: participant {key[3]!r} has no "
                        f"directive on host {self.host!r}",
                    )
                self._changed.wait(min(left, 0.1))

    def _on_chunk(self, frame: Frame) -> Response:
        h = frame.header
        a = h.allreduce
        op = self._wait_for((a.job, a.name, int(a.seq), a.to_participant))
        if op.state != "planned":
            raise AllreduceError("allreduce_failed", op.ended())
        if a.index >= len(op.chunks) or a.count != len(op.chunks):  # chunks are fixed once planned
            raise AllreduceError(
                "allreduce_failed",
                f"{op.name()}: chunk {a.index}/{a.count}, expected {len(op.chunks)} chunks",
            )
        c = op.chunks[a.index]
        route = op.route(a.index)
        if (
            a.offset != c.lo
            or h.payload_bytes != c.hi - c.lo
            or layouts_from_pb(h.tensors) != list(c.layouts)
        ):
            raise AllreduceError(
                "allreduce_mismatch",
                f"{op.name()}: chunk {a.index} from {a.from_participant!r} does not match "
                f"this participant's tensors",
            )
        # The checks and the bookkeeping hold op.lock; the summing and copying of the chunk's
        # bytes do not (other chunks of the operation, and its senders, go on meanwhile).
        with op.lock:
            if op.state != "planned":
                raise AllreduceError("allreduce_failed", op.ended())
            if a.phase == REDUCE:
                if a.from_participant not in route.children:
                    raise AllreduceError(
                        "allreduce_failed",
                        f"{op.name()}: {a.from_participant!r} does not send partial sums of chunk "
                        f"{a.index} here (its children: {list(route.children)})",
                    )
                incoming = set(a.summed)
                if incoming and incoming <= op.summed[a.index] and a.from_participant in incoming:
                    return self._ack(h)  # a repeated frame: summed once already
                overlap = incoming & op.summed[a.index]
                if overlap or a.from_participant not in incoming:
                    raise AllreduceError(
                        "allreduce_failed",
                        f"{op.name()}: chunk {a.index} from {a.from_participant!r} would count "
                        f"{sorted(overlap) or 'no contribution of its sender'} twice",
                    )
                op.summed[a.index] |= incoming  # claimed: a repeat arriving meanwhile is ACKed only
                chunk_lock = op.chunk_locks.setdefault(a.index, threading.Lock())
            else:
                if a.from_participant != route.source:
                    raise AllreduceError(
                        "allreduce_failed",
                        f"{op.name()}: {a.from_participant!r} does not send the result of chunk "
                        f"{a.index} here (its source: {route.source!r})",
                    )
                if op.have[a.index] or a.index in op.copying:
                    return self._ack(h)
                op.copying.add(a.index)
        try:
            if a.phase == REDUCE:
                with chunk_lock:  # one chunk's sums, one at a time
                    acc = op.accs.get(a.index)
                    if acc is None:  # the participant's own chunk is the first member, in place
                        own = memoryview(op.data)[c.lo : c.hi]
                        acc = op.accs[a.index] = Accumulator(c.layouts, own)
                        acc.add(own)
                    acc.add(frame.payload)
                    complete = acc.count == len(route.children) + 1
                    if complete:
                        acc.finish()
                        op.accs.pop(a.index, None)
                        with memoryview(op.data)[c.lo : c.hi] as summed:  # in cache: for its frame
                            crc = _native.crc32(summed)
                if complete:
                    op.crcs[(REDUCE, a.index)] = op.crcs[(BROADCAST, a.index)] = crc
                    self._reduced(op, a.index)
            else:
                op.data[c.lo : c.hi] = frame.payload
                op.crcs[(BROADCAST, a.index)] = h.payload_crc32  # verified on arrival
                self._result_chunk(op, a.index)
        except ValueError as exc:  # the operation failed meanwhile: its mappings are closed
            raise AllreduceError("allreduce_failed", f"{op.ended()} ({exc})") from exc
        return self._ack(h)

    def _ack(self, h: Any) -> Response:
        return Response(
            FrameHeader(
                kind=_ACK, update_id=h.update_id, src_host=self.host, outcome=control_pb2.OUTCOME_APPLIED
            )
        )

    # ------------------------------------------------------------------ ending

    def fail(self, key: Key, code: str, reason: str, *, tell: bool = True) -> None:
        """Fail ``key`` here: the process gets ``LocalError(code, reason)``; the scheduler (``tell``) too."""
        with self._lock:
            op = self._ops.get(key)
        if op is None:
            return
        with op.lock:
            if op.state in ("done", "failed"):
                return
            op.state = "failed"
            op.why = reason
        _LOG.info("%s failed: %s", op.name(), reason)
        op.conn.error(op.request_id, code, reason)
        self._finish(op, reason)
        if tell:
            job, name, seq, participant = key
            done = control_pb2.AllreduceDone(
                job=job, name=name, seq=seq, participant=participant, ok=False, reason=reason, code=code
            )
            self._control(control_pb2.DaemonMessage(allreduce_done=done))

    def _finish(self, op: Op, why: str) -> None:
        for s in op.senders.values():
            s.stop()
        with self._changed:
            key = op.key
            if self._ops.get(key) is op:
                del self._ops[key]
            self._gone[key] = why
            while len(self._gone) > 4096:
                self._gone.popitem(last=False)
            self._changed.notify_all()
        with op.lock:
            op.accs.clear()  # their views of the result mapping
        self._close(op)  # a sender still sending keeps the mapping alive (BufferError, below)

    def _close(self, op: Op) -> None:
        try:
            op.data.close()
        except BufferError:  # a view still exported (a frame being sent): the GC closes it
            _LOG.debug("%s: mapping still in use at close", op.name())
        with contextlib.suppress(OSError):
            os.close(op.fd)
