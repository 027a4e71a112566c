"""Data-plane framing: daemon <-> daemon bulk transfer of updates and models (DESIGN §7, §9).

A frame on the wire (see ``proto/mlfabric/v1/dataplane.proto``)::

    b"MLF1" | 4-byte big-endian header length | FrameHeader | payload | [CRC-32 trailer]

The payload is the update's (or aggregate's, or model's) tensors concatenated as the header's
``tensors`` layout lists them, protected by a CRC-32 (zlib's checksum, by the C extension
:mod:`mlfabric.wire._native`) carried in the header, or in a 4-byte trailer when the sender
did not know it in advance. The bytes move over plain TCP sockets, not gRPC, so that one
transfer runs at link speed (MLfabric §4: the daemons, not the training processes, move the
bytes; the scheduler only sees reports).

Sending takes the payload either as a buffer or as a :class:`FileSpan` of a memfd (sent with
``os.sendfile``, or from a mapping through TLS); the frame's prefix and header are encoded once
into one ``bytes`` (:func:`encode_header`) and go out with ``MSG_MORE`` ahead of the payload.
Receiving goes into a buffer the caller allocates (``alloc(nbytes)``; the daemon hands out
memfd-backed mmaps, see :mod:`mlfabric.wire.memfd`, so it can pass the fd on to the server
process), ``recv_into(..., MSG_WAITALL)`` in pieces of about 1 MiB, each checked (CRC-32 and
NaN/inf, :func:`~mlfabric.daemon.channels.payloadio.recv_payload`) while it is in cache. Pass
the CRC in when it is known (e.g. computed when the update was handed to the daemon): the
sender then never reads the payload itself. Sockets are blocking with their I/O timeout in the
kernel (:func:`~mlfabric.daemon.channels.sockets.set_io_timeout`): no poll precedes a call.

Every rule a frame can break raises :class:`FrameError` naming the problem. Functions here are
blocking and thread-safe as long as each socket is used by one thread at a time. With
:mod:`.payloadio` this is where bytes go in and out (the data path's speed work belongs here;
connections to peers are :mod:`.peers`).
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from google.protobuf.message import DecodeError

from mlfabric.daemon.channels.framecheck import (
    DTYPE_ITEMSIZE,
    FrameError,
    FrameLimits,
    check_header,
)
from mlfabric.daemon.channels.payloadio import (
    RECV_PIECE_BYTES,
    STREAM_PIECE_BYTES,
    FileSpan,
    Payload,
    PayloadWatch,
    StreamedPayload,
    non_finite_reason,
    payload_crc32,
    payload_length,
    recv_exact,
    recv_payload,
    release_payload,
    send_payload,
    update_frames,
    wait_readable,
)
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.daemon.channels.sockets import io_timeout
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.wire import _native
from mlfabric.wire.tensors import pack_layout

__all__ = [
    "DTYPE_ITEMSIZE",
    "MAGIC",
    "Alloc",
    "FileSpan",
    "Frame",
    "FrameError",
    "FrameHeader",
    "FrameLimits",
    "IdleTimeout",
    "Payload",
    "PayloadWatch",
    "TransferStats",
    "check_header",
    "encode_header",
    "error_header",
    "non_finite_reason",
    "payload_crc32",
    "payload_length",
    "recv_frame",
    "send_frame",
    "update_frames",
]

FrameHeader = dataplane_pb2.FrameHeader

#: The four bytes every frame starts with.
MAGIC = b"MLF1"
_PREFIX = struct.Struct(">4sI")
_CRC = struct.Struct(">I")

#: Bytes handed to the kernel per ``sendfile``/``send`` call (and per token-bucket reservation).
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
#: Payloads up to this size (from a buffer) go out in one ``sendall`` with their header.
_SMALL_BYTES = 64 * 1024


#: What a sender checks its own headers against (the layout, not the sizes).
_SENDER_LIMITS = FrameLimits(max_header_bytes=1 << 32, max_payload_bytes=1 << 62)

#: ``alloc(nbytes)`` returns a writable buffer of at least ``nbytes`` bytes.
Alloc: TypeAlias = Callable[[int], Any]


@dataclass(frozen=True)
class TransferStats:
    """Measurement of one frame's byte movement (reported to the scheduler, MLfabric §4).

    Parameters
    ----------
    bytes : int
        Payload bytes moved (the header is not counted).
    start, end : float
        Wall-clock (``time.time()``) instants the frame's first byte went / last byte arrived.

    Examples
    --------
    >>> TransferStats(bytes=2_000_000, start=10.0, end=10.5).throughput
    4000000.0
    """

    bytes: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        """Duration of the byte movement in seconds."""
        return max(0.0, self.end - self.start)

    @property
    def throughput(self) -> float:
        """Payload bytes per second (0.0 when nothing moved or no time elapsed)."""
        secs = self.seconds
        return self.bytes / secs if secs > 0 and self.bytes > 0 else 0.0


@dataclass
class Frame:
    """A received frame.

    Parameters
    ----------
    header : FrameHeader
        The parsed and checked header; ``payload_crc32`` holds the verified CRC-32 (also when
        it came as a trailer), so a daemon forwarding the payload can pass it on.
    payload : memoryview
        Exactly ``header.payload_bytes`` bytes (a view of ``buffer``; empty when there is none).
    buffer : object or None
        What ``alloc`` returned (None for an empty payload, for which ``alloc`` is not called).
    stats : TransferStats
        When the frame started and finished arriving.
    finite_checked : bool
        Every float tensor of the payload was tested for NaN and infinity as it arrived (in the
        CRC pass; :func:`recv_frame`'s ``check_finite``); ``non_finite`` holds the result.
    non_finite : str or None
        When checked: the name of the first tensor holding a NaN or an infinity, or None.
    """

    header: Any
    payload: memoryview
    buffer: Any
    stats: TransferStats
    finite_checked: bool = False
    non_finite: str | None = None

    def release(self) -> None:
        """Done with the payload: drop the view and give its buffer back (a pooled memfd goes back
        for the next frame; a ``bytearray`` is left to the collector). Idempotent."""
        release_payload(self.payload, self.buffer)


def error_header(reason: str, *, update_id: str = "", src_host: str = "") -> Any:
    """An ERROR frame header carrying ``reason``.

    Examples
    --------
    >>> error_header("unknown job 'x'").reason
    "unknown job 'x'"
    """
    return FrameHeader(
        kind=dataplane_pb2.FRAME_KIND_ERROR,
        reason=reason,
        update_id=update_id,
        src_host=src_host,
        outcome=control_pb2.OUTCOME_UNSPECIFIED,
    )


def encode_header(header: Any, payload_bytes: int, crc32: int, crc_trailer: bool) -> bytes:
    """A frame's first bytes: magic, header length and ``header`` with its payload fields set.

    ``payload_bytes``, ``payload_crc32`` and ``crc_trailer`` are appended to ``header``'s
    serialization as fields of their own where they differ from it (a later field overrides an
    earlier one when protobuf parses), so ``header`` is neither copied nor modified.

    Examples
    --------
    >>> h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id="u", payload_bytes=1)
    >>> raw = encode_header(h, 12, 0xABC, False)
    >>> parsed = FrameHeader.FromString(raw[8:])
    >>> raw[:4], parsed.payload_bytes, parsed.payload_crc32, parsed.update_id, h.payload_bytes
    (b'MLF1', 12, 2748, 'u', 1)
    """
    raw = header.SerializeToString()
    if header.payload_bytes != payload_bytes:
        raw += b"\x50" + _varint(payload_bytes)  # field 10, varint
    if header.payload_crc32 != crc32:
        raw += b"\x58" + _varint(crc32)  # field 11, varint
    if header.crc_trailer != crc_trailer:
        raw += b"\x88\x01" + (b"\x01" if crc_trailer else b"\x00")  # field 17, varint
    return _PREFIX.pack(MAGIC, len(raw)) + raw


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def send_frame(
    sock: socket.socket,
    header: Any,
    payload: Payload | None = None,
    *,
    crc32: int | None = None,
    bucket: TokenBucket | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    zero_copy: bool = True,
) -> TransferStats:
    """Send one frame; block until every byte is handed to the kernel.

    ``payload_bytes``, ``payload_crc32`` and ``crc_trailer`` go on the wire with the header
    (:func:`encode_header`; the caller's message is not modified). Without ``crc32`` the CRC is
    computed while the payload goes out and sent as a 4-byte trailer (``crc_trailer``), so no
    separate pass over the payload delays the first byte. The header is checked with
    :func:`check_header` (without size limits) first, so a bad layout fails here and not at the
    peer. The encoded header goes out with ``MSG_MORE``, in the same segments as the payload.

    Parameters
    ----------
    sock : socket.socket
        A connected stream socket (see :func:`~mlfabric.daemon.channels.sockets.set_io_timeout`;
        one with a Python timeout is switched to the kernel's).
    header : FrameHeader
        The header; its ``kind`` and ``tensors`` describe the payload.
    payload : bytes-like or FileSpan, optional
        The payload; a :class:`FileSpan` (a memfd's bytes) goes out with ``os.sendfile``.
    crc32 : int, optional
        The payload's CRC-32 when the caller already has it (e.g. computed by the pushing
        process): it goes in the header and a :class:`FileSpan` is sent without being read
        in user space at all.
    bucket : TokenBucket, optional
        Egress rate limit, consumed per chunk before the chunk is written.
    chunk_bytes : int
        Bytes per write call and per token reservation.
    zero_copy : bool
        Send a :class:`FileSpan` with ``os.sendfile`` (default; not through TLS) instead of
        ``sendall`` from a mapping of it.

    Returns
    -------
    TransferStats
        Payload bytes and the wall-clock start and end of the send.

    Raises
    ------
    FrameError
        The header's layout does not describe the payload.
    OSError
        The socket failed (peer gone: ``BrokenPipeError``/``ConnectionResetError``;
        ``TimeoutError`` naming the I/O timeout).

    Examples
    --------
    >>> a, b = socket.socketpair()
    >>> h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_GET, job="j", server="s")
    >>> send_frame(a, h).bytes
    0
    >>> recv_frame(b, FrameLimits()).header.job
    'j'
    """
    size = payload_length(payload)
    tls = isinstance(sock, ssl.SSLSocket)
    if not tls and sock.gettimeout() is not None:
        io_timeout(sock)  # a Python timeout becomes the kernel's: no poll before each call
    trailer = crc32 is None and size > 0  # compute the CRC while sending, append it
    check_header(header, _SENDER_LIMITS, payload_bytes=size)
    prefix = encode_header(header, size, 0 if crc32 is None else crc32, trailer)
    start = time.time()
    try:
        if payload is None or size == 0:
            sock.sendall(prefix)
        elif (
            not isinstance(payload, (FileSpan, StreamedPayload))
            and size <= _SMALL_BYTES
            and (bucket is None or not bucket.enabled)
        ):
            small = memoryview(payload).cast("B")  # one segment
            tail = _CRC.pack(_native.crc32(small)) if trailer else b""
            sock.sendall(b"".join((prefix, small, tail)))
        else:
            sock.sendall(prefix, 0 if tls else socket.MSG_MORE)
            send_payload(
                sock,
                payload,
                trailer=trailer,
                chunk_bytes=chunk_bytes,
                bucket=bucket,
                zero_copy=zero_copy and not tls,  # sendfile would bypass TLS
            )
    except BlockingIOError as exc:  # the kernel's SO_SNDTIMEO
        raise _timed_out("send: the peer took", sock) from exc
    return TransferStats(bytes=size, start=start, end=time.time())


class IdleTimeout(FrameError):
    """A connection sent no frame for the receiver's idle timeout; it is closed (nothing was lost).

    Examples
    --------
    >>> IdleTimeout("no frame for 5 s").reply_possible
    False
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason, reply_possible=False)


def _fill(
    sock: socket.socket,
    view: memoryview,
    got: int,
    what: str,
    deadline: float | None,
    late: Callable[[int], FrameError],
) -> None:
    """Fill ``view[got:]`` (:func:`recv_exact`); ``late(got)`` past ``deadline``, or the peer closed."""
    got = recv_exact(sock, view, got, deadline)
    if got < len(view):
        if deadline is not None and time.monotonic() >= deadline:
            raise late(got)
        raise FrameError(f"peer closed mid-frame ({what}: {got} of {len(view)} bytes)", reply_possible=False)


def _timed_out(what: str, sock: socket.socket) -> TimeoutError:
    return TimeoutError(f"{what}: no bytes for {io_timeout(sock) or 0:g} s (I/O timeout)")


def recv_frame(
    sock: socket.socket,
    limits: FrameLimits,
    alloc: Alloc = bytearray,
    *,
    bucket: TokenBucket | None = None,
    chunk_bytes: int = RECV_PIECE_BYTES,
    idle_timeout: float | None = None,
    header_timeout: float | None = None,
    check_finite: Callable[[Any], bool] | None = update_frames,
    watch: Callable[[Any, memoryview], PayloadWatch | None] | None = None,
) -> Frame | None:
    """Receive one frame, checking every rule; None when the peer closed between frames.

    Parameters
    ----------
    sock : socket.socket
        A connected stream socket (see :func:`~mlfabric.daemon.channels.sockets.set_io_timeout`;
        one with a Python timeout is switched to the kernel's).
    limits : FrameLimits
        Header and payload size limits, checked before anything is allocated.
    alloc : callable
        ``alloc(nbytes)`` returns a writable buffer of at least ``nbytes`` bytes for the payload
        (default ``bytearray``; the daemon passes memfd-backed mmaps). Not called for 0 bytes.
    bucket : TokenBucket, optional
        Ingress rate limit, consumed per piece after the piece is read.
    chunk_bytes : int
        Bytes per ``recv_into`` call at most (each piece is checked while it is in cache).
    idle_timeout : float, optional
        Seconds to wait for the frame's first byte (``math.inf``: forever, whatever the
        socket's timeout; None: the socket's timeout applies); then :class:`IdleTimeout`.
    header_timeout : float, optional
        Seconds from the frame's first byte until its whole header (prefix included) has
        arrived (None: no limit): a slow peer is cut off with a :class:`FrameError` naming
        the limit. The payload is bounded by the socket's own timeout per ``recv_into``.
    check_finite : callable or None
        ``check_finite(header)``: test this frame's float tensors for NaN and infinity in the
        CRC pass, the result in ``Frame.non_finite`` (default :func:`update_frames`; None:
        never). The frame is received whole either way: what to do with a non-finite update
        is the caller's (the job's) decision.
    watch : callable, optional
        ``watch(header, payload)`` once the header is checked and the payload's buffer is
        allocated: a :class:`~mlfabric.daemon.channels.payloadio.PayloadWatch` told of every
        piece as it lands (pieces of at most
        :data:`~mlfabric.daemon.channels.payloadio.STREAM_PIECE_BYTES`) and of a receive that
        fails (before this raises), or None (not watched). A pipelined aggregate's members.

    Returns
    -------
    Frame or None
        The frame, or None on a clean close before its first byte.

    Raises
    ------
    FrameError
        Bad magic, header too long or unparsable, payload too large, layout broken, CRC
        mismatch, the peer closed mid-frame, the header came too slowly (``header_timeout``),
        or ``alloc`` failed (``MemoryError``/``OSError``); :class:`IdleTimeout` when no frame
        began within ``idle_timeout``.
    OSError
        The socket failed (``ConnectionResetError``; ``TimeoutError`` naming the I/O timeout).

    Examples
    --------
    >>> a, b = socket.socketpair()
    >>> h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id="u1")
    >>> _ = h.tensors.add(name="w", dtype="uint8", shape=[3], offset=0, nbytes=3)
    >>> _ = send_frame(a, h, b"abc")
    >>> f = recv_frame(b, FrameLimits())
    >>> f.header.update_id, bytes(f.payload)
    ('u1', b'abc')
    """
    if not isinstance(sock, ssl.SSLSocket) and sock.gettimeout() is not None:
        io_timeout(sock)  # a Python timeout becomes the kernel's: no poll before each call
    if idle_timeout is not None and not wait_readable(sock, idle_timeout):
        raise IdleTimeout(f"no frame for {idle_timeout:g} s (idle timeout)")
    head = memoryview(bytearray(_PREFIX.size))
    try:
        got = sock.recv_into(head)  # the first bytes: (at least) one arrived or the peer closed
    except (BlockingIOError, TimeoutError):
        raise _timed_out("waiting for a frame", sock) from None
    if got == 0:  # EOF between frames
        return None
    start = time.time()
    deadline = None if header_timeout is None else time.monotonic() + header_timeout

    def late(what: str, size: int) -> Callable[[int], FrameError]:
        return lambda got: FrameError(
            f"frame header not received within {header_timeout:g} s "
            f"({what}: {got} of {size} bytes; header timeout)"
        )

    try:
        _fill(sock, head, got, "prefix", deadline, late("prefix", _PREFIX.size))
        magic, hlen = _PREFIX.unpack(head)
        if magic != MAGIC:
            raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})", reply_possible=False)
        if hlen > limits.max_header_bytes:
            raise FrameError(f"header of {hlen} bytes exceeds the limit of {limits.max_header_bytes}")
        raw = bytearray(hlen)
        _fill(sock, memoryview(raw), 0, "header", deadline, late("header", hlen))
    except (BlockingIOError, TimeoutError):
        raise _timed_out("frame header", sock) from None
    header = FrameHeader()
    try:
        header.ParseFromString(bytes(raw))
    except DecodeError as exc:
        raise FrameError(f"header does not parse: {exc}") from exc
    check_header(header, limits)
    size = header.payload_bytes
    if size == 0:
        if header.payload_crc32 != 0:
            raise FrameError(f"CRC-32 mismatch: header says {header.payload_crc32:#010x}, empty payload")
        return Frame(header, memoryview(b""), None, TransferStats(0, start, time.time()))
    try:
        buffer = alloc(size)
    except (MemoryError, OSError) as exc:
        raise FrameError(f"cannot allocate {size} bytes for update {header.update_id!r}: {exc!r}") from exc
    payload = memoryview(buffer).cast("B")[:size]
    if payload.nbytes < size or payload.readonly:
        raise ValueError(f"alloc({size}) returned {payload.nbytes} bytes (readonly={payload.readonly})")
    checked = bool(check_finite and check_finite(header))
    layout = pack_layout(header.tensors) if checked else b""
    watcher = watch(header, payload) if watch is not None else None
    piece = chunk_bytes if watcher is None else min(chunk_bytes, STREAM_PIECE_BYTES)
    try:
        try:
            got, crc, bad = recv_payload(
                sock,
                payload,
                layout,
                piece_bytes=piece,
                bucket=bucket,
                progress=None if watcher is None else watcher.progress,
            )
            if got < size:
                raise FrameError(
                    f"peer closed mid-frame (payload: {got} of {size} bytes)", reply_possible=False
                )
            if header.crc_trailer:
                trailer = memoryview(bytearray(_CRC.size))
                _fill(sock, trailer, 0, "CRC-32 trailer", None, late("CRC-32 trailer", _CRC.size))
                (expected,) = _CRC.unpack(trailer)
            else:
                expected = header.payload_crc32
        except (BlockingIOError, TimeoutError):
            raise _timed_out(f"payload of update {header.update_id!r}", sock) from None
        end = time.time()
        if crc != expected:
            raise FrameError(
                f"CRC-32 mismatch on update {header.update_id!r}: sender says {expected:#010x}, "
                f"payload has {crc:#010x}"
            )
    except BaseException as exc:
        if watcher is not None:
            watcher.abort(str(exc) if isinstance(exc, FrameError) else repr(exc))
        raise
    header.payload_crc32, header.crc_trailer = crc, False  # verified: forward it without re-reading
    frame = Frame(header, payload, buffer, TransferStats(size, start, end))
    if checked:
        frame.finite_checked, frame.non_finite = True, header.tensors[bad].name if bad >= 0 else None
    return frame
