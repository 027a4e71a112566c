"""The all-reduce role of a daemon: summing up a tree and broadcasting down it (docs/allreduce.md).

A local process calls ``allreduce`` (``AllreduceRequest``, its contribution in a memfd). The
daemon checks the tensors, keeps the memfd, and tells the scheduler ``AllreduceReady``. Once
every participant is in and they agree, the scheduler sends each participant's daemon an
``AllreduceDirective``: its parent and children in the tree and the chunk size. Then, chunk by
chunk (pipelined):

- **reduce**: a participant sums (:class:`~mlfabric.aggregators.kernels.Accumulator`, in
  place in its result memfd) its own chunk and each child's partial sum, and sends the chunk
  to its parent. A leaf's partial sum is its own contribution, sent from its memfd. Each
  partial sum names the participants it holds: a repeated frame is ACKed and not summed again,
  and a frame whose participants overlap what the chunk already holds is refused, so nothing is
  counted twice; the root checks that every chunk holds all ``world_size`` participants.
- **broadcast**: the root's finished chunks, and every chunk received from the parent, go to
  the children. Once every chunk of the result is in and forwarded, the result memfd goes to
  the local process (``AllreduceResult``) and ``AllreduceDone`` to the scheduler.

Failures never hang: a peer that cannot be reached, a refused frame, the local process
disconnecting, the scheduler stream breaking, or the participant's deadline passing fail the
operation here (a ``LocalError`` to the process, ``AllreduceDone{ok=false}`` to the scheduler,
which aborts it at every other participant with ``AllreduceAbort``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlfabric.aggregators.kernels import Accumulator
from mlfabric.daemon.allreduce_chunks import Chunk, split_chunks
from mlfabric.daemon.dataplane import Frame, FrameHeader, error_header
from mlfabric.daemon.listener import Response
from mlfabric.daemon.localapi import LocalConnection
from mlfabric.daemon.transport import PeerUnavailable
from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2
from mlfabric.tensors import DTYPES, layouts_from_pb, layouts_to_pb

__all__ = ["DEFAULT_TIMEOUT", "AllreduceRole"]

_LOG = logging.getLogger("mlfabric.daemon")
_UPDATE = dataplane_pb2.FRAME_KIND_UPDATE
_ACK = dataplane_pb2.FRAME_KIND_ACK
REDUCE, BROADCAST = 1, 2
#: Seconds a participant waits for the result when its request gives no timeout.
DEFAULT_TIMEOUT = 60.0
#: Seconds a chunk that arrives before its operation's directive waits for it.
EARLY_WAIT = 10.0
#: Chunks in flight (unACKed) per peer of an operation: one sending thread and connection each.
SEND_WINDOW = 2
Key = tuple[str, str, int, str]  # job, name, seq, participant


class AllreduceError(Exception):
    """An all-reduce failed; ``code`` is the local error code, the message names the problem."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class _Op:
    """One participant's part in one all-reduce, on this daemon."""

    key: Key
    conn: LocalConnection
    request_id: int
    fd: int
    own: mmap.mmap
    tensors: list[Any]  # TensorLayout messages
    payload_bytes: int
    world_size: int
    result_fd: int
    result: mmap.mmap
    deadline: float
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    directive: Any = None
    chunks: list[Chunk] = field(default_factory=list)
    accs: dict[int, Accumulator] = field(default_factory=dict)
    #: per chunk being summed: the lock its sums take (the bytes are summed outside ``lock``)
    chunk_locks: dict[int, threading.Lock] = field(default_factory=dict)
    #: chunks of the result being copied in from the parent
    copying: set[int] = field(default_factory=set)
    summed: list[set[str]] = field(default_factory=list)
    have: list[bool] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=list)
    senders: list[_Sender] = field(default_factory=list)
    state: str = "waiting"  # -> planned -> done | failed

    def name(self) -> str:
        job, name, seq, participant = self.key
        return f"all-reduce {name!r}#{seq} of job {job!r} (participant {participant!r})"


class _Sender:
    """Sends one operation's chunks to one peer on :data:`SEND_WINDOW` threads (connections).

    Each thread sends a chunk and waits for its ACK; with several threads taking chunks from
    one queue (in queue order), the next chunk is already on the wire while the peer sums and
    ACKs the previous one, so the ACK's round trip (behind the reverse direction's queue on a
    shaped link) does not idle the link. Chunks may arrive out of order; the receiver keys
    everything by chunk index.
    """

    def __init__(self, role: AllreduceRole, op: _Op, peer: Any, phase: int) -> None:
        self.role, self.op, self.peer, self.phase = role, op, peer, phase
        self.queue: queue.Queue[int | None] = queue.Queue()
        self.threads = [
            threading.Thread(target=self._run, name="allreduce-send", daemon=True) for _ in range(SEND_WINDOW)
        ]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while (index := self.queue.get()) is not None:
            if not self.role.send_chunk(self.op, self.peer, self.phase, index):
                return

    def stop(self) -> None:
        """End every thread once the chunks queued before are sent (or the operation failed)."""
        for _ in self.threads:
            self.queue.put(None)


class AllreduceRole:
    """The all-reduces of this daemon's processes (thread-safe). :meth:`stop` fails what is left.

    Parameters
    ----------
    host : str
        This daemon's host.
    control : callable
        ``control(DaemonMessage) -> bool`` sends to the scheduler (False: not connected).
    request : callable
        ``request(address, header, payload) -> Reply``: one frame to a peer daemon
        (``PushSender.request``); raises ``PeerUnavailable``.
    clock : callable
        Monotonic seconds.
    """

    def __init__(
        self,
        host: str,
        control: Callable[[Any], bool],
        request: Callable[..., Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self._control = control
        self._request = request
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ops: dict[Key, _Op] = {}
        #: recently finished or failed operations: key -> why (a late frame is refused at once)
        self._gone: collections.OrderedDict[Key, str] = collections.OrderedDict()
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ local API

    def on_request(self, conn: LocalConnection, request: Any, fd: int | None) -> int | None:
        """A local ``AllreduceRequest``: check it, keep the memfd, announce it. Returns an fd to close."""
        req, rid = request.allreduce, request.request_id
        key: Key = (req.job, req.name, int(req.seq), req.participant)
        problem = self._check(req, fd)
        if problem is not None:
            conn.error(rid, *problem)
            return fd
        assert fd is not None
        timeout = req.timeout_seconds if req.timeout_seconds > 0 else DEFAULT_TIMEOUT
        size = req.payload_bytes
        own = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)
        result_fd = os.memfd_create("mlfabric-allreduce", os.MFD_CLOEXEC)
        os.ftruncate(result_fd, size)
        result = mmap.mmap(result_fd, size) if size else mmap.mmap(-1, 1)
        now = self._clock()
        op = _Op(
            key,
            conn,
            rid,
            fd,
            own,
            list(req.tensors),
            size,
            req.world_size,
            result_fd,
            result,
            now + timeout,
            now,
        )
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
        ready = control_pb2.AllreduceReady(
            job=req.job,
            name=req.name,
            seq=req.seq,
            participant=req.participant,
            world_size=req.world_size,
            tensors=[
                control_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in req.tensors
            ],
            bytes=size,
            timeout_seconds=timeout,
        )
        if not self._control(control_pb2.DaemonMessage(allreduce_ready=ready)):
            self.fail(key, "unavailable", f"{op.name()}: the scheduler is not connected", tell=False)
        return None

    def _check(self, req: Any, fd: int | None) -> tuple[str, str] | None:
        """``(code, message)`` of what is wrong with a request, or None."""
        if not req.participant or not req.name or not req.job:
            return "bad_request", "an all-reduce needs a job, a name and a participant"
        if req.world_size < 1:
            return "bad_request", f"world_size must be >= 1, got {req.world_size}"
        if fd is None:
            return "bad_request", "all-reduce without a payload memfd"
        problem = self._check_layout(req, fd)
        return None if problem is None else ("bad_tensor", problem)

    @staticmethod
    def _check_layout(req: Any, fd: int) -> str | None:
        end = 0
        for t in sorted(req.tensors, key=lambda t: t.offset):
            if t.dtype not in DTYPES:
                return f"tensor {t.name!r}: cannot sum dtype {t.dtype!r} (known: {sorted(DTYPES)})"
            count = 1
            for d in t.shape:
                count *= int(d)
            if count * DTYPES[t.dtype].itemsize != t.nbytes or t.offset != end:
                return f"tensor {t.name!r}: bad layout (offset {t.offset}, {t.nbytes} bytes)"
            end += t.nbytes
        if end != req.payload_bytes:
            return f"tensor layout covers {end} bytes but payload_bytes is {req.payload_bytes}"
        if os.fstat(fd).st_size < req.payload_bytes:
            return f"payload memfd holds {os.fstat(fd).st_size} bytes, the request says {req.payload_bytes}"
        return None

    def connection_closed(self, conn: LocalConnection) -> None:
        """The process of ``conn`` went away: its operations fail (the others are told)."""
        with self._lock:
            keys = [k for k, op in self._ops.items() if op.conn is conn]
        for key in keys:
            self.fail(
                key, "allreduce_peer_lost", f"participant {key[3]!r}'s process disconnected from its daemon"
            )

    # ------------------------------------------------------------------ directives

    def on_directive(self, d: Any) -> None:
        """``AllreduceDirective``: this participant's place in the tree; start moving chunks."""
        key: Key = (d.job, d.name, int(d.seq), d.participant)
        with self._lock:
            op = self._ops.get(key)
        if op is None:
            _LOG.info("all-reduce directive for %s, which is not (or no longer) here", key)
            return
        with op.lock:
            if op.state != "waiting":
                return
            op.directive = d
            op.chunks = split_chunks(layouts_from_pb(op.tensors), op.payload_bytes, max(1, d.chunk_bytes))
            n = len(op.chunks)
            op.summed = [{d.participant} for _ in range(n)]
            op.have = [False] * n
            op.forwarded = [0] * n
            op.state = "planned"
            up = _Sender(self, op, d.parent, REDUCE) if d.parent.participant else None
            downs = [_Sender(self, op, c, BROADCAST) for c in d.children]
            op.senders = ([up] if up else []) + downs
        with self._changed:
            self._changed.notify_all()
        if not d.children:  # a leaf: its partial sums are its own chunks
            if not d.parent.participant and op.payload_bytes:  # a world of one: the result is its own
                op.result[: op.payload_bytes] = op.own[: op.payload_bytes]
            for c in op.chunks:
                self._reduced(op, c.index)

    def on_abort(self, a: Any) -> None:
        """``AllreduceAbort``: fail every local participant of the operation with its reason."""
        with self._lock:
            keys = [k for k in self._ops if k[:3] == (a.job, a.name, int(a.seq))]
        for key in keys:
            self.fail(key, a.code or "allreduce_failed", a.reason, tell=False)

    def scheduler_lost(self, reason: str) -> None:
        """The control stream broke: every operation fails (the scheduler forgets them too)."""
        with self._lock:
            keys = list(self._ops)
        for key in keys:
            self.fail(key, "unavailable", f"scheduler connection lost: {reason}", tell=False)

    def tick(self) -> None:
        """Fail operations past their deadline."""
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
        with self._lock:
            keys = list(self._ops)
        for key in keys:
            self.fail(key, "unavailable", f"daemon of host {self.host!r} shut down")

    # ------------------------------------------------------------------ chunks

    def _reduced(self, op: _Op, index: int) -> None:
        """Chunk ``index``'s partial sum is complete here: up to the parent, or (root) down."""
        d = op.directive
        if d.parent.participant:
            op.senders[0].queue.put(index)
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

    def _result_chunk(self, op: _Op, index: int) -> None:
        """Chunk ``index`` of the result is here: forward it to the children; deliver when complete."""
        with op.lock:
            op.have[index] = True
            children = [s for s in op.senders if s.phase == BROADCAST]
        for s in children:
            s.queue.put(index)
        self._maybe_done(op)

    def _maybe_done(self, op: _Op) -> None:
        n_children = len(op.directive.children)
        with op.lock:
            if op.state != "planned" or not all(op.have) or any(f < n_children for f in op.forwarded):
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
        op.conn.send(local_pb2.LocalEvent(request_id=op.request_id, allreduce_result=result), op.result_fd)
        seconds = self._clock() - op.started
        self._finish(op, "delivered")
        job, name, seq, participant = op.key
        done = control_pb2.AllreduceDone(
            job=job, name=name, seq=seq, participant=participant, ok=True, seconds=seconds
        )
        self._control(control_pb2.DaemonMessage(allreduce_done=done))

    def send_chunk(self, op: _Op, peer: Any, phase: int, index: int) -> bool:
        """Send chunk ``index`` to ``peer`` (a sender thread); False once the operation failed."""
        with op.lock:
            if op.state != "planned":
                return False
            c = op.chunks[index]
            leaf = phase == REDUCE and not op.directive.children
            summed = sorted(op.summed[index]) if phase == REDUCE else []
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
        source = op.own if leaf else op.result
        payload = memoryview(source)[c.lo : c.hi]
        try:
            reply = self._request(peer.data_address, header, payload)
        except (PeerUnavailable, OSError, ValueError) as exc:
            self.fail(
                op.key,
                "allreduce_peer_lost",
                f"{op.name()}: sending chunk {index} to participant {peer.participant!r} on host "
                f"{peer.host!r} failed: {exc}",
            )
            return False
        finally:
            payload.release()
        reply.payload.release()
        if reply.buffer is not None and hasattr(reply.buffer, "release"):
            reply.buffer.release()
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
            frame.payload.release()
            if frame.buffer is not None and hasattr(frame.buffer, "release"):
                frame.buffer.release()

    def _wait_for(self, key: Key) -> _Op:
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
        d = op.directive
        if op.state != "planned":
            raise AllreduceError("allreduce_failed", f"{op.name()} has ended ({op.state})")
        if a.index >= len(op.chunks) or a.count != len(op.chunks):  # chunks are fixed once planned
            raise AllreduceError(
                "allreduce_failed",
                f"{op.name()}: chunk {a.index}/{a.count}, expected {len(op.chunks)} chunks",
            )
        c = op.chunks[a.index]
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
                raise AllreduceError("allreduce_failed", f"{op.name()} has ended ({op.state})")
            if a.phase == REDUCE:
                if a.from_participant not in {x.participant for x in d.children}:
                    raise AllreduceError(
                        "allreduce_failed", f"{op.name()}: {a.from_participant!r} is not a child in the tree"
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
                if a.from_participant != d.parent.participant:
                    raise AllreduceError(
                        "allreduce_failed",
                        f"{op.name()}: {a.from_participant!r} is not the parent in the tree",
                    )
                if op.have[a.index] or a.index in op.copying:
                    return self._ack(h)
                op.copying.add(a.index)
        try:
            if a.phase == REDUCE:
                with chunk_lock:  # one chunk's sums, one at a time
                    acc = op.accs.get(a.index)
                    if acc is None:
                        acc = op.accs[a.index] = Accumulator(c.layouts, memoryview(op.result)[c.lo : c.hi])
                        own = memoryview(op.own)[c.lo : c.hi]
                        acc.add(own)
                        own.release()
                    acc.add(frame.payload)
                    complete = acc.count == len(d.children) + 1
                    if complete:
                        acc.finish()
                        op.accs.pop(a.index, None)
                if complete:
                    self._reduced(op, a.index)
            else:
                op.result[c.lo : c.hi] = frame.payload
                self._result_chunk(op, a.index)
        except ValueError as exc:  # the operation failed meanwhile: its mappings are closed
            raise AllreduceError("allreduce_failed", f"{op.name()} has ended ({op.state}): {exc}") from exc
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
        _LOG.info("%s failed: %s", op.name(), reason)
        op.conn.error(op.request_id, code, reason)
        self._finish(op, reason)
        if tell:
            job, name, seq, participant = key
            done = control_pb2.AllreduceDone(
                job=job, name=name, seq=seq, participant=participant, ok=False, reason=reason, code=code
            )
            self._control(control_pb2.DaemonMessage(allreduce_done=done))

    def _finish(self, op: _Op, why: str) -> None:
        for s in op.senders:
            s.stop()
        with self._changed:
            if self._ops.get(op.key) is op:
                del self._ops[op.key]
            self._gone[op.key] = why
            while len(self._gone) > 4096:
                self._gone.popitem(last=False)
            self._changed.notify_all()
        with op.lock:
            op.accs.clear()  # their views of the result mapping
        self._close(op)  # a sender still sending keeps the mapping alive (BufferError, below)

    def _close(self, op: _Op) -> None:
        for m in (op.own, op.result):
            try:
                m.close()
            except BufferError:  # a view still exported (a frame being sent): the GC closes it
                _LOG.debug("%s: mapping still in use at close", op.name())
        for fd in (op.fd, op.result_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
