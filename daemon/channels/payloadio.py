"""Moving a payload's bytes on the data plane: memfd spans and their mapping, ``sendfile``, the
receive loop with its CRC-32 and NaN/inf test, releasing a received payload (DESIGN §9).

:mod:`mlfabric.daemon.channels.frames` says what a frame is (header, limits, checks) and sends and
receives it with these (it re-exports :class:`FileSpan`, :func:`payload_length` and
:func:`payload_crc32`); together they are the one place bytes go in and out of a daemon, where
the data path's speed work belongs.

The sockets are blocking with their I/O timeout in the kernel
(:func:`~mlfabric.daemon.channels.sockets.set_io_timeout`): each ``recv_into``/``sendfile`` is one
system call, no poll before it. A payload is received in pieces of :data:`RECV_PIECE_BYTES` with
``MSG_WAITALL``, and each piece, while it is still in the core's cache, goes through
:func:`mlfabric.wire._native.check`: its CRC-32 and the NaN/inf test of the float tensors it
holds, in one pass in C.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.daemon.channels.sockets import io_timeout, set_receive_timeout
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire import _native

__all__ = [
    "RECV_PIECE_BYTES",
    "STREAM_PIECE_BYTES",
    "FileSpan",
    "Payload",
    "PayloadAborted",
    "PayloadWatch",
    "StreamedPayload",
    "mapped",
    "non_finite_reason",
    "payload_crc32",
    "payload_length",
    "recv_exact",
    "recv_payload",
    "release_payload",
    "send_payload",
    "update_frames",
    "wait_readable",
]


#: Bytes received (``MSG_WAITALL``), then checksummed and tested, at a time: in cache for the check.
RECV_PIECE_BYTES = 1 << 20


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


#: Bytes per piece of a payload that is forwarded while it arrives (a watched receive, a
#: :class:`StreamedPayload`): the pipeline's fill per hop is one piece's time on the link.
STREAM_PIECE_BYTES = 256 * 1024


class PayloadAborted(Exception):
    """A :class:`StreamedPayload` will never be complete (what it is computed from failed).

    The frame carrying it is cut off mid-payload: its receiver sees the connection close before
    the CRC-32 trailer and discards it, so nothing built from it was applied anywhere.
    """


@dataclass(frozen=True)
class StreamedPayload:
    """A payload sent while it is still being produced (a pipelined aggregate's sum).

    ``view`` holds the bytes; ``wait(upto)`` blocks until ``view[:upto]`` is final (raising
    :class:`PayloadAborted` if it never will be). :func:`send_payload` calls it before each
    piece of :data:`STREAM_PIECE_BYTES` and computes the CRC-32 trailer as the pieces go.

    Examples
    --------
    >>> StreamedPayload(memoryview(bytearray(8)), lambda upto: None).view.nbytes
    8
    """

    view: memoryview
    wait: Callable[[int], None]


class PayloadWatch(Protocol):
    """Told how a payload's receive goes while it lands (``recv_frame``'s ``watch``)."""

    def progress(self, got: int) -> None:
        """The first ``got`` bytes of the payload are in its buffer (not yet CRC-checked)."""

    def abort(self, reason: str) -> None:
        """The payload will not complete (peer gone, timeout, CRC mismatch): ``reason``."""


#: A payload to send: any contiguous buffer, a span of a file descriptor, or a streamed one.
Payload: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap | FileSpan | StreamedPayload"


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
    if isinstance(payload, StreamedPayload):
        return payload.view.nbytes
    return memoryview(payload).nbytes


def payload_crc32(payload: Payload | None) -> int:
    """CRC-32 (zlib's) of the payload's bytes; a :class:`FileSpan` is read through mmap.

    Examples
    --------
    >>> import zlib
    >>> payload_crc32(b"hello") == zlib.crc32(b"hello")
    True
    """
    if payload is None:
        return 0
    if isinstance(payload, StreamedPayload):
        raise TypeError("a streamed payload's CRC-32 is computed while it is sent")
    if not isinstance(payload, FileSpan):
        return _native.crc32(memoryview(payload).cast("B"))
    if payload.length == 0:
        return 0
    with mapped(payload) as view:
        return _native.crc32(view)


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


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` has input (or EOF) within ``seconds`` (``math.inf``: wait as long as it takes).

    One ``poll``: the wait for a frame's first byte (the idle timeout), once per frame; the
    socket's own timeouts are not changed.
    """
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True  # TLS: bytes already decrypted are not seen by poll
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(None if math.isinf(seconds) else max(0, int(seconds * 1000) + 1)))


def recv_exact(sock: socket.socket, view: memoryview, got: int = 0, deadline: float | None = None) -> int:
    """Receive into ``view[got:]`` until it is full or the peer closed; the bytes ``view`` holds then.

    Without ``deadline`` the socket's I/O timeout bounds each call (``BlockingIOError`` or
    ``TimeoutError``). With ``deadline`` (monotonic seconds) what is there already is taken
    first without waiting (a header usually comes in the segment of its prefix); only then is
    the socket's receive timeout set to the time left, each call waits at most until the
    deadline, what arrived by then is returned (a peer trickling bytes is cut off, not waited
    for), and the timeout is set back.
    """
    size = len(view)
    tls = isinstance(sock, ssl.SSLSocket)
    waiting = 0 if tls else socket.MSG_WAITALL
    first = deadline is not None and not tls  # take what is there (MSG_DONTWAIT) before waiting
    restore: float | None = None
    changed = False
    try:
        while got < size:
            flags = socket.MSG_DONTWAIT if first else waiting
            if deadline is not None and not first:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return got
                if not changed:
                    restore, changed = io_timeout(sock), True
                set_receive_timeout(sock, remaining)
            try:
                k = sock.recv_into(view[got:], size - got, flags)
            except (BlockingIOError, TimeoutError):
                if first:
                    first = False
                    continue
                if deadline is None:
                    raise
                return got
            first = False
            if k == 0:
                return got
            got += k
        return got
    finally:
        if changed:
            set_receive_timeout(sock, restore)


def recv_payload(
    sock: socket.socket,
    payload: memoryview,
    layout: bytes,
    *,
    piece_bytes: int = RECV_PIECE_BYTES,
    bucket: TokenBucket | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, int, int]:
    """Receive ``len(payload)`` bytes into ``payload``, checking each piece as it lands.

    Parameters
    ----------
    sock : socket.socket
        Blocking, with its I/O timeout in the kernel (or a TLS socket).
    payload : memoryview
        Writable bytes, exactly the payload's size.
    layout : bytes
        :func:`~mlfabric.wire.tensors.pack_layout` of the tensors to test for NaN and infinity
        (empty: CRC only).
    piece_bytes : int
        Bytes per ``recv_into`` call at most (and per test; an element cut by a piece
        boundary is tested with the piece it ends in).
    bucket : TokenBucket, optional
        Ingress rate limit, consumed per piece after it is read.
    progress : callable, optional
        ``progress(got)`` after each piece: the first ``got`` bytes are in ``payload``.

    Returns
    -------
    tuple of int
        Bytes received (less than asked when the peer closed), the CRC-32 of those, and the
        index in ``layout`` of the first tensor holding a NaN or an infinity (-1: none).

    Raises
    ------
    BlockingIOError, TimeoutError
        Nothing arrived for the socket's I/O timeout.
    """
    size = len(payload)
    waitall = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    crc, bad, got = 0, -1, 0
    while got < size:
        n = min(piece_bytes, size - got)
        k = sock.recv_into(payload[got : got + n], n, waitall)
        if k == 0:
            break
        crc, found = _native.check(payload, got, got + k, crc, layout)
        if found >= 0 and bad < 0:
            bad, layout = found, b""  # the first one is reported: no more testing
        got += k
        if bucket is not None:
            bucket.consume(k)
        if progress is not None:
            progress(got)
    return got, crc, bad


def send_payload(
    sock: socket.socket,
    payload: Payload,
    *,
    trailer: bool,
    chunk_bytes: int,
    bucket: TokenBucket | None = None,
    zero_copy: bool = True,
) -> int:
    """Send ``payload``'s bytes (and its CRC-32 trailer when ``trailer``); the CRC-32 (0: not computed).

    A :class:`FileSpan` goes out with ``os.sendfile`` (``zero_copy``; never read in user space
    unless its CRC must be computed here), else from a mapping of it; a buffer with ``sendall``;
    a :class:`StreamedPayload` in pieces of :data:`STREAM_PIECE_BYTES`, each once it is final.
    The CRC-32 of a ``trailer`` is computed piece by piece just before each piece is sent.
    """
    size = payload_length(payload)
    streamed = isinstance(payload, StreamedPayload)
    with contextlib.ExitStack() as stack:
        view: memoryview | None = None  # the bytes, when they are read here
        if isinstance(payload, StreamedPayload):
            view = payload.view
            chunk_bytes = min(chunk_bytes, STREAM_PIECE_BYTES)
        elif not isinstance(payload, FileSpan):
            view = memoryview(payload).cast("B")
        elif trailer or not zero_copy:
            view = stack.enter_context(mapped(payload))
        sendfile = isinstance(payload, FileSpan) and zero_copy
        crc = 0
        for pos in range(0, size, chunk_bytes):
            n = min(chunk_bytes, size - pos)
            if streamed:
                assert isinstance(payload, StreamedPayload)
                payload.wait(pos + n)  # PayloadAborted: the frame is cut off here, never completed
            if bucket is not None:
                bucket.consume(n)
            if trailer:
                assert view is not None
                crc = _native.crc32(view[pos : pos + n], crc)
            if sendfile:
                assert isinstance(payload, FileSpan)
                _sendfile(sock, payload, pos, n)
            else:
                assert view is not None
                sock.sendall(view[pos : pos + n])
    if trailer:
        sock.sendall(crc.to_bytes(4, "big"))
    return crc


def _sendfile(sock: socket.socket, span: FileSpan, pos: int, n: int) -> None:
    """Send bytes ``[pos, pos + n)`` of ``span`` with ``os.sendfile`` (the socket is blocking)."""
    offset, stop = span.offset + pos, span.offset + pos + n
    out = sock.fileno()
    while offset < stop:
        sent = os.sendfile(out, span.fd, offset, stop - offset)
        if sent == 0:
            raise EOFError(f"sendfile: fd {span.fd} ended at offset {offset}, before {stop}")
        offset += sent
