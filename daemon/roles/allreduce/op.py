"""One participant's all-reduce operation on a daemon, its chunk senders, and request checks.

Split from :mod:`mlfabric.daemon.roles.allreduce.role` (the role that moves the chunks): :class:`Op`
holds a participant's buffers and per-chunk bookkeeping, :class:`Sender` sends its chunks to
one peer, :func:`check_request` says what is wrong with a local ``AllreduceRequest``.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlfabric.aggregators.kernels import Accumulator
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.roles.allreduce.chunks import Chunk
from mlfabric.daemon.roles.allreduce.routes import Route
from mlfabric.proto.v1 import control_pb2
from mlfabric.wire.tensors import DTYPES

__all__ = ["SEND_WINDOW", "AllreduceError", "Key", "Op", "Sender", "check_request", "ready_message"]

#: Chunks in flight (unACKed) per peer of an operation: one sending thread and connection each.
SEND_WINDOW = 2
Key = tuple[str, str, int, str]  # job, name, seq, participant


class AllreduceError(Exception):
    """An all-reduce failed; ``code`` is the local error code, the message names the problem."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Op:
    """One participant's part in one all-reduce, on this daemon."""

    key: Key
    conn: LocalConnection
    request_id: int
    #: the process's memfd: its contribution, then, chunk by chunk, the partial sums and the
    #: result in place (the process gets it back with the result; DESIGN §9)
    fd: int
    data: mmap.mmap  # ``fd`` mapped shared, read-write
    tensors: list[Any]  # TensorLayout messages
    payload_bytes: int
    world_size: int
    deadline: float
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    directive: Any = None
    chunks: list[Chunk] = field(default_factory=list)
    segment_of: list[int] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    accs: dict[int, Accumulator] = field(default_factory=dict)
    #: per chunk being summed: the lock its sums take (the bytes are summed outside ``lock``)
    chunk_locks: dict[int, threading.Lock] = field(default_factory=dict)
    #: chunks of the result being copied in from the parent
    copying: set[int] = field(default_factory=set)
    summed: list[set[str]] = field(default_factory=list)
    have: list[bool] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=list)
    #: (phase, chunk) -> the CRC-32 of the bytes that phase sends, when known (a received result
    #: chunk's, checked on arrival; a sum's, computed while it is in cache)
    crcs: dict[tuple[int, int], int] = field(default_factory=dict)
    senders: dict[str, Sender] = field(default_factory=dict)  # peer participant -> its sender
    state: str = "waiting"  # -> planned -> done | failed
    #: why it failed (the first reason; a peer refused a chunk because of it names it again)
    why: str = ""

    def ended(self) -> str:
        """``"has ended (done)"``, or ``"has ended (failed: why)"``: a refusal that names the cause."""
        return f"{self.name()} has ended ({self.state}{': ' + self.why if self.why else ''})"

    def route(self, index: int) -> Route:
        """Chunk ``index``'s children, parent and result forwarding here."""
        return self.routes[self.segment_of[index]]

    def name(self) -> str:
        job, name, seq, participant = self.key
        return f"all-reduce {name!r}#{seq} of job {job!r} (participant {participant!r})"


class Sender:
    """Sends one operation's chunks (``(phase, index)``) to one peer on :data:`SEND_WINDOW` threads.

    Each thread sends a chunk and waits for its ACK; with several threads taking chunks from
    one queue (in queue order), the next chunk is already on the wire while the peer sums and
    ACKs the previous one, so the ACK's round trip (behind the reverse direction's queue on a
    shaped link) does not idle the link. Chunks may arrive out of order; the receiver keys
    everything by chunk index. ``send_chunk(op, peer, phase, index) -> bool`` sends one (False:
    the operation failed, the thread ends).
    """

    def __init__(self, send_chunk: Callable[[Op, Any, int, int], bool], op: Op, peer: Any) -> None:
        self._send_chunk, self.op, self.peer = send_chunk, op, peer
        self.queue: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self.threads = [
            threading.Thread(target=self._run, name="allreduce-send", daemon=True) for _ in range(SEND_WINDOW)
        ]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if not self._send_chunk(self.op, self.peer, *item):
                return

    def stop(self) -> None:
        """End every thread once the chunks queued before are sent (or the operation failed)."""
        for _ in self.threads:
            self.queue.put(None)


def ready_message(req: Any, nbytes: int, timeout: float, **extra: Any) -> Any:
    """The ``AllreduceReady`` announcing the local ``AllreduceRequest`` ``req`` to the scheduler
    (``extra``: the process-group fields, ``plan_only`` and the like)."""
    tensors = [control_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in req.tensors]
    return control_pb2.AllreduceReady(
        job=req.job,
        name=req.name,
        seq=req.seq,
        participant=req.participant,
        world_size=req.world_size,
        tensors=tensors,
        bytes=nbytes,
        timeout_seconds=timeout,
        **extra,
    )


def check_request(req: Any, fd: int | None) -> tuple[str, str] | None:
    """``(code, message)`` of what is wrong with an ``AllreduceRequest``, or None.

    A ``plan_only`` request (a process group runs the operation) has no payload; its process
    rank must be one of the world's.
    """
    if not req.participant or not req.name or not req.job:
        return "bad_request", "an all-reduce needs a job, a name and a participant"
    if req.world_size < 1:
        return "bad_request", f"world_size must be >= 1, got {req.world_size}"
    if req.plan_only and not 0 <= req.process_rank < req.world_size:
        return "bad_request", f"process_rank {req.process_rank} is not a rank of a world of {req.world_size}"
    if fd is None and not req.plan_only:
        return "bad_request", "all-reduce without a payload memfd"
    problem = _check_layout(req, None if req.plan_only else fd)
    return None if problem is None else ("bad_tensor", problem)


def _check_layout(req: Any, fd: int | None) -> str | None:
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
    if fd is not None and os.fstat(fd).st_size < req.payload_bytes:
        return f"payload memfd holds {os.fstat(fd).st_size} bytes, the request says {req.payload_bytes}"
    return None
