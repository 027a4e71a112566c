"""Moving a payload's bytes on the data plane: memfd spans and their mapping, ``sendfile``, the
pipelined CRC-32 with the NaN/inf scan, releasing a received payload (DESIGN §9).

:mod:`mlfabric.daemon.channels.frames` says what a frame is (header, limits, checks) and sends and
receives it with these (it re-exports :class:`FileSpan`, :func:`payload_length` and
:func:`payload_crc32`); together they are the one place bytes go in and out of a daemon, where
the data path's speed work belongs.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.crc import crc32
from mlfabric.wire.tensors import FiniteScan

__all__ = [
    "FUSED_PIECE_BYTES",
    "THREADED_CRC_BYTES",
    "Crc32Follower",
    "FileSpan",
    "Payload",
    "SendfileWriter",
    "mapped",
    "non_finite_reason",
    "payload_crc32",
    "payload_length",
    "release_payload",
    "update_frames",
]


#: Payloads at least this large get their CRC-32 computed on a helper thread.
THREADED_CRC_BYTES = 8 * 1024 * 1024
_CRC_STEP_BYTES = 1024 * 1024
#: Bytes CRC'd then scanned for NaN/inf at a time (fits a core's L2 cache).
FUSED_PIECE_BYTES = 256 * 1024


@dataclass(frozen=True)
class FileSpan:
    """A payload that sits in a file (a memfd): ``length`` bytes of ``fd`` from ``offset``.

    The fd stays owned by the caller; the data plane only reads it.

    Examples
    --------
    >>> FileSpan(fd=3, offset=0, length=16).length
    16
    """

    fd: int
    offset: int
    length: int


#: A payload to send: any contiguous buffer, or a span of a file descriptor.
Payload: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap | FileSpan"


def payload_length(payload: Payload | None) -> int:
    """Number of bytes in ``payload`` (0 for None).

    Examples
    --------
    >>> payload_length(b"abc"), payload_length(None), payload_length(FileSpan(3, 8, 100))
    (3, 0, 100)
    """
    if payload is None:
        return 0
    if isinstance(payload, FileSpan):
        return payload.length
    return memoryview(payload).nbytes


def payload_crc32(payload: Payload | None) -> int:
    """CRC-32 (:func:`crc32`) of the payload's bytes; a :class:`FileSpan` is read through mmap.

    Examples
    --------
    >>> import zlib
    >>> payload_crc32(b"hello") == zlib.crc32(b"hello")
    True
    """
    if payload is None:
        return 0
    if not isinstance(payload, FileSpan):
        return crc32(memoryview(payload).cast("B"))
    if payload.length == 0:
        return 0
    with mapped(payload) as view:
        return crc32(view)


def update_frames(header: Any) -> bool:
    """``recv_frame``'s default ``check_finite`` (dataplane): UPDATE frames but replicated entries.

    A replicated log entry (``replica_version`` set) was checked where it was first applied.

    Examples
    --------
    >>> update_frames(dataplane_pb2.FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE))
    True
    >>> update_frames(dataplane_pb2.FrameHeader(kind=dataplane_pb2.FRAME_KIND_MODEL))
    False
    """
    return bool(header.kind == dataplane_pb2.FRAME_KIND_UPDATE and not header.replica_version)


def non_finite_reason(tensor: str, update_id: str, refused_by: str) -> str:
    """The DROPPED reason of an update refused for holding NaN or infinity (one wording everywhere).

    Examples
    --------
    >>> print(non_finite_reason("w", "h/1/2", "server 'ps0'")[:57])
    tensor 'w' of h/1/2 holds non-finite values (NaN or inf);
    """
    return (
        f"tensor {tensor!r} of {update_id} holds non-finite values (NaN or inf); {refused_by} "
        "refuses them (Params(refuse_non_finite=False) allows them)"
    )


def release_payload(payload: memoryview, buffer: Any) -> None:
    """Release ``payload`` (a view) and ``buffer`` (what ``alloc`` gave, if it has ``release``).

    Examples
    --------
    >>> buf = bytearray(4)
    >>> view = memoryview(buf)
    >>> release_payload(view, buf)
    >>> len(view)
    Traceback (most recent call last):
    ValueError: operation forbidden on released memoryview object
    """
    payload.release()
    release = getattr(buffer, "release", None)
    if release is not None:
        release()


@contextlib.contextmanager
def mapped(span: FileSpan) -> Iterator[memoryview]:
    """A read-only view of ``span``'s bytes, mapped in one go (``MAP_POPULATE``)."""
    start = span.offset - span.offset % mmap.ALLOCATIONGRANULARITY
    skip = span.offset - start
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with mmap.mmap(span.fd, skip + span.length, flags, mmap.PROT_READ, offset=start) as mm:
        view = memoryview(mm)
        part = view[skip : skip + span.length]
        try:
            yield part
        finally:
            part.release()
            view.release()


class Crc32Follower:
    """CRC-32 of a growing prefix of ``view``; on a helper thread for large payloads.

    :func:`crc32` releases the GIL, so on a multi-core host the checksum of bytes already
    received (or handed to the kernel) runs beside the socket copy of the next ones instead of
    after it. Payloads under :data:`THREADED_CRC_BYTES`, and single-CPU hosts, do it inline.
    ``view`` None means nothing to compute. Use as a context manager: leaving it stops the thread.

    With ``scan`` (a :class:`~mlfabric.tensors.FiniteScan` of the payload's layout), each piece
    of :data:`FUSED_PIECE_BYTES` is tested for NaN and infinity right after its CRC, while it is
    still in cache: the receiver's one read of the payload does both (DESIGN §9).
    """

    def __init__(self, view: memoryview | None, size: int, scan: FiniteScan | None = None) -> None:
        self._view = view
        self._scan = scan
        self._crc = 0
        self._done = 0  # bytes checksummed
        self._fed = 0  # bytes handed to the thread
        self._end = 0  # bytes final so far
        self._queue: queue.SimpleQueue[int | None] | None = None
        self._thread: threading.Thread | None = None
        if view is not None and size >= THREADED_CRC_BYTES and (os.cpu_count() or 1) > 1:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="mlfabric-crc32", daemon=True)
            self._thread.start()

    def __enter__(self) -> Crc32Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def advance(self, end: int) -> None:
        """Bytes ``[0, end)`` of the view are final."""
        if self._view is None:
            return
        self._end = end
        if self._queue is None:
            self._consume(end)
        elif end - self._fed >= _CRC_STEP_BYTES:
            self._queue.put(end)
            self._fed = end

    def result(self) -> int:
        """The CRC-32 of bytes ``[0, end)`` of the last :meth:`advance`."""
        if self._queue is not None and self._end > self._fed:
            self._queue.put(self._end)
            self._fed = self._end
        self._stop()
        return self._crc

    def _run(self) -> None:
        assert self._queue is not None and self._view is not None
        while (end := self._queue.get()) is not None:
            self._consume(end)

    def _consume(self, end: int) -> None:
        """CRC (and scan) bytes ``[done, end)``: piece by piece when scanning, so each is in cache."""
        assert self._view is not None
        if self._scan is None or self._scan.done:
            self._crc = crc32(self._view[self._done : end], self._crc)
        else:
            for pos in range(self._done, end, FUSED_PIECE_BYTES):
                stop = min(end, pos + FUSED_PIECE_BYTES)
                self._crc = crc32(self._view[pos:stop], self._crc)
                self._scan.scan(self._view, stop)
        self._done = end

    def _stop(self) -> None:
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class SendfileWriter:
    """Writes ranges of a :class:`FileSpan` to a socket with ``os.sendfile``, honouring its timeout."""

    def __init__(self, sock: socket.socket, span: FileSpan) -> None:
        self._fd = sock.fileno()
        self._timeout = sock.gettimeout()
        self._span = span
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLOUT)

    def send(self, pos: int, n: int) -> None:
        """Send bytes ``[pos, pos + n)`` of the span."""
        offset, stop = self._span.offset + pos, self._span.offset + pos + n
        timeout = self._timeout
        while offset < stop:
            try:
                sent = os.sendfile(self._fd, self._span.fd, offset, stop - offset)
            except BlockingIOError:
                if not self._poller.poll(None if timeout is None else timeout * 1000):
                    raise TimeoutError(f"sendfile: no progress within {timeout} s") from None
                continue
            if sent == 0:
                raise EOFError(f"sendfile: fd {self._span.fd} ended at offset {offset}, before {stop}")
            offset += sent
