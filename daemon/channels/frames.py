"""Data-plane framing: daemon <-> daemon bulk transfer of updates and models (DESIGN §7, §9).

A frame on the wire (see ``proto/mlfabric/v1/dataplane.proto``)::

    b"MLF1" | 4-byte big-endian header length | FrameHeader | payload | [CRC-32 trailer]

The payload is the update's (or aggregate's, or model's) tensors concatenated as the header's
``tensors`` layout lists them, protected by a CRC-32 (zlib's checksum; computed with ISA-L when
``isal`` is installed, see :func:`~mlfabric.wire.crc.crc32`) carried in the header, or in
a 4-byte trailer when the sender did not know it in advance. The bytes move over plain TCP
sockets, not gRPC, so that one transfer runs at link speed (MLfabric §4: the daemons, not the
training processes, move the bytes; the scheduler only sees reports).

Sending takes the payload either as a buffer or as a :class:`FileSpan` of a memfd (mapped and
sent with ``sendall``, or ``os.sendfile``). Receiving goes into a buffer the caller allocates
(``alloc(nbytes)``; the daemon hands out memfd-backed mmaps, see
:mod:`mlfabric.wire.memfd`, so it can pass the fd on to the server process),
``recv_into`` in large chunks, with the CRC computed on a helper thread right behind the copy.
Pass the CRC in when it is known (e.g. computed when the update was handed to the daemon): the
sender then never reads the payload itself.

Every rule a frame can break raises :class:`FrameError` naming the problem. Functions here are
blocking and thread-safe as long as each socket is used by one thread at a time. With
:mod:`.payloadio` this is where bytes go in and out (the data path's speed work belongs here;
connections to peers are :mod:`.peers`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from google.protobuf.message import DecodeError

from mlfabric.daemon.channels.payloadio import (
    Crc32Follower,
    FileSpan,
    Payload,
    SendfileWriter,
    mapped,
    non_finite_reason,
    payload_crc32,
    payload_length,
    release_payload,
    update_frames,
)
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.wire.crc import crc32 as _crc32
from mlfabric.wire.tensors import FiniteScan, layouts_from_pb

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
    "TransferStats",
    "check_header",
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

#: Bytes per element of the dtypes a tensor layout may name (DESIGN §7).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
}

#: Bytes moved per ``send``/``recv_into``/``sendfile`` call (and per token-bucket reservation).
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class FrameLimits:
    """What a receiver accepts.

    Parameters
    ----------
    max_header_bytes : int
        Largest serialized :class:`FrameHeader` (the 4-byte length field is checked against it
        before any header byte is read).
    max_payload_bytes : int
        Largest ``payload_bytes`` (checked before the payload buffer is allocated).

    Examples
    --------
    >>> FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 20).max_payload_bytes
    1048576
    """

    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 4 << 30


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


class FrameError(Exception):
    """A frame broke a rule of the data plane; the message names the problem.

    Parameters
    ----------
    reason : str
        What was wrong (``"bad magic b'GET '"``, ``"CRC-32 mismatch ..."``, ...).
    reply_possible : bool
        True when the peer speaks the protocol and the stream is still in step, so an ERROR
        frame can be sent back before closing; False (bad magic, peer gone) otherwise.

    Examples
    --------
    >>> str(FrameError("payload of 10 bytes exceeds the limit of 4"))
    'payload of 10 bytes exceeds the limit of 4'
    """

    def __init__(self, reason: str, *, reply_possible: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.reply_possible = reply_possible


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


def check_header(header: Any, limits: FrameLimits) -> None:
    """Check a header's kind, payload size and tensor layout; raise :class:`FrameError` if broken.

    The layout rules: every tensor has a known dtype, non-negative dims and
    ``nbytes == prod(shape) * itemsize``; tensors lie inside the payload, do not overlap, and
    together cover exactly ``payload_bytes`` (a non-empty payload must be described).

    Parameters
    ----------
    header : FrameHeader
        The header to check.
    limits : FrameLimits
        The receiver's limits.

    Examples
    --------
    >>> h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, payload_bytes=8)
    >>> _ = h.tensors.add(name="w", dtype="float32", shape=[2], offset=0, nbytes=8)
    >>> check_header(h, FrameLimits())
    >>> h.payload_bytes = 12
    >>> try:
    ...     check_header(h, FrameLimits())
    ... except FrameError as exc:
    ...     print(exc)
    tensor layout covers 8 bytes but payload_bytes is 12
    """
    if header.kind not in dataplane_pb2.FrameKind.values() or header.kind == 0:
        raise FrameError(f"unknown frame kind {header.kind}")
    size = header.payload_bytes
    if size > limits.max_payload_bytes:
        raise FrameError(f"payload of {size} bytes exceeds the limit of {limits.max_payload_bytes}")
    spans: list[tuple[int, int, str]] = []
    for t in header.tensors:
        itemsize = DTYPE_ITEMSIZE.get(t.dtype)
        if itemsize is None:
            raise FrameError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        count = 1
        for dim in t.shape:
            if dim < 0:
                raise FrameError(f"tensor {t.name!r}: negative dimension in shape {list(t.shape)}")
            count *= dim
        if count * itemsize != t.nbytes:
            raise FrameError(
                f"tensor {t.name!r}: nbytes {t.nbytes} != {count} elements x {itemsize} bytes "
                f"({t.dtype}, shape {list(t.shape)})"
            )
        if t.offset + t.nbytes > size:
            raise FrameError(
                f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) out of range "
                f"of a {size}-byte payload"
            )
        spans.append((t.offset, t.nbytes, t.name))
    spans.sort()
    for (off_a, len_a, name_a), (off_b, _len_b, name_b) in itertools.pairwise(spans):
        if off_a + len_a > off_b:
            raise FrameError(f"tensors {name_a!r} and {name_b!r} overlap")
    covered = sum(n for _, n, _ in spans)
    if covered != size:
        raise FrameError(f"tensor layout covers {covered} bytes but payload_bytes is {size}")


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

    ``payload_bytes``, ``payload_crc32`` and ``crc_trailer`` are set on a copy of ``header`` (the
    caller's message is not modified). Without ``crc32`` the CRC is computed while the payload
    goes out and sent as a 4-byte trailer (``crc_trailer``), so no separate pass over the payload
    delays the first byte. The header is checked with :func:`check_header` (without size limits)
    first, so a bad layout fails here and not at the peer.

    Parameters
    ----------
    sock : socket.socket
        A connected stream socket (blocking, or with a timeout).
    header : FrameHeader
        The header; its ``kind`` and ``tensors`` describe the payload.
    payload : bytes-like or FileSpan, optional
        The payload; a :class:`FileSpan` (a memfd's bytes) is mapped (``zero_copy``: sendfile).
    crc32 : int, optional
        The payload's CRC-32 when the caller already has it (e.g. computed by the pushing
        process): it goes in the header and a :class:`FileSpan` is sent without being read
        in user space at all.
    bucket : TokenBucket, optional
        Egress rate limit, consumed per chunk before the chunk is written.
    chunk_bytes : int
        Bytes per write call and per token reservation.
    zero_copy : bool
        Send a :class:`FileSpan` with ``os.sendfile`` (default) instead of ``sendall`` from a
        mapping of it. On a quiet machine sendfile measured 1.5-2.7x the mapped path's rate on
        loopback and 0.27-0.55 vs 0.64-0.73 CPU seconds per GB (``experiments/bench_dataplane.py``);
        under heavy load from other processes the two were about even.

    Returns
    -------
    TransferStats
        Payload bytes and the wall-clock start and end of the send.

    Raises
    ------
    FrameError
        The header's layout does not describe the payload.
    OSError
        The socket failed (peer gone: ``BrokenPipeError``/``ConnectionResetError``; ``TimeoutError``).

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
    zero_copy = zero_copy and not isinstance(sock, ssl.SSLSocket)  # sendfile would bypass TLS
    out = FrameHeader()
    out.CopyFrom(header)
    out.payload_bytes = size
    trailer = crc32 is None and size > 0  # compute the CRC while sending, append it
    out.crc_trailer = trailer
    out.payload_crc32 = 0 if crc32 is None else crc32
    check_header(out, FrameLimits(max_header_bytes=1 << 32, max_payload_bytes=1 << 62))
    raw = out.SerializeToString()
    prefix = _PREFIX.pack(MAGIC, len(raw)) + raw
    start = time.time()
    if payload is None or size == 0:
        sock.sendall(prefix)
        return TransferStats(bytes=0, start=start, end=time.time())
    if not isinstance(payload, FileSpan) and size <= 64 * 1024 and (bucket is None or not bucket.enabled):
        small = memoryview(payload).cast("B")  # one segment
        tail = _CRC.pack(_crc32(small)) if trailer else b""
        sock.sendall(b"".join((prefix, small, tail)))
        return TransferStats(bytes=size, start=start, end=time.time())
    sock.sendall(prefix)
    with contextlib.ExitStack() as stack:
        view: memoryview | None = None  # the payload's bytes, when they must be read here
        writer: SendfileWriter | None = None
        if isinstance(payload, FileSpan):
            if zero_copy:
                writer = SendfileWriter(sock, payload)
            if trailer or not zero_copy:
                view = stack.enter_context(mapped(payload))
        else:
            view = memoryview(payload).cast("B")
        crc = stack.enter_context(Crc32Follower(view if trailer else None, size))
        for pos in range(0, size, chunk_bytes):
            n = min(chunk_bytes, size - pos)
            if bucket is not None:
                bucket.consume(n)
            crc.advance(pos + n)  # on a helper thread for large payloads: beside the send
            if writer is not None:
                writer.send(pos, n)
            elif view is not None:
                sock.sendall(view[pos : pos + n])
        if trailer:
            sock.sendall(_CRC.pack(crc.result()))
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


def _wait_readable(sock: socket.socket, deadline: float | None) -> bool:
    """Whether ``sock`` has input (or EOF) before ``deadline`` (monotonic; None: do not wait here)."""
    if deadline is None or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
        return True  # TLS: bytes already decrypted are not seen by poll
    remaining = deadline - time.monotonic()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    if math.isinf(remaining):
        return bool(poller.poll())
    return bool(poller.poll(max(0, int(remaining * 1000) + 1) if remaining > 0 else 0))


def _recv_exact(
    sock: socket.socket,
    n: int,
    what: str,
    *,
    at_boundary: bool = False,
    deadline: float | None = None,
    late: Callable[[int], FrameError] | None = None,
) -> bytes:
    """Read exactly ``n`` bytes; empty on EOF before the first byte when ``at_boundary``.

    With ``deadline`` (monotonic seconds), ``late(got)`` is raised when the bytes are not all
    there by then (a peer trickling a header byte by byte is cut off, not waited for).
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if not _wait_readable(sock, deadline):
            assert late is not None
            raise late(got)
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and at_boundary:
                return b""
            raise FrameError(f"peer closed mid-frame ({what}: {got} of {n} bytes)", reply_possible=False)
        got += k
    return bytes(buf)


def recv_frame(
    sock: socket.socket,
    limits: FrameLimits,
    alloc: Alloc = bytearray,
    *,
    bucket: TokenBucket | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    idle_timeout: float | None = None,
    header_timeout: float | None = None,
    check_finite: Callable[[Any], bool] | None = update_frames,
) -> Frame | None:
    """Receive one frame, checking every rule; None when the peer closed between frames.

    Parameters
    ----------
    sock : socket.socket
        A connected stream socket (blocking, or with a timeout).
    limits : FrameLimits
        Header and payload size limits, checked before anything is allocated.
    alloc : callable
        ``alloc(nbytes)`` returns a writable buffer of at least ``nbytes`` bytes for the payload
        (default ``bytearray``; the daemon passes memfd-backed mmaps). Not called for 0 bytes.
    bucket : TokenBucket, optional
        Ingress rate limit, consumed per chunk after the chunk is read.
    chunk_bytes : int
        Bytes per ``recv_into`` call at most.
    idle_timeout : float, optional
        Seconds to wait for the frame's first byte (``math.inf``: forever, whatever the
        socket's timeout; None: the socket's timeout applies); then :class:`IdleTimeout`.
    header_timeout : float, optional
        Seconds from the frame's first byte until its whole header (prefix included) has
        arrived (None: no limit): a slow peer is cut off with a :class:`FrameError` naming
        the limit. The payload is bounded by the socket's own timeout per ``recv_into``.
    check_finite : callable or None
        ``check_finite(header)``: test this frame's float tensors for NaN and infinity in the
        CRC pass (:class:`~mlfabric.tensors.FiniteScan`), the result in ``Frame.non_finite``
        (default :func:`update_frames`; None: never). The frame is received whole either way:
        what to do with a non-finite update is the caller's (the job's) decision.

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
        The socket failed (``ConnectionResetError``, ``TimeoutError``).

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
    if idle_timeout is not None and not _wait_readable(sock, time.monotonic() + idle_timeout):
        raise IdleTimeout(f"no frame for {idle_timeout:g} s (idle timeout)")
    deadline = None if header_timeout is None else time.monotonic() + header_timeout

    def late(what: str, size: int) -> Callable[[int], FrameError]:
        return lambda got: FrameError(
            f"frame header not received within {header_timeout:g} s "
            f"({what}: {got} of {size} bytes; header timeout)"
        )

    head = _recv_exact(
        sock, _PREFIX.size, "prefix", at_boundary=True, deadline=deadline, late=late("prefix", _PREFIX.size)
    )
    if not head:  # EOF between frames
        return None
    start = time.time()
    magic, hlen = _PREFIX.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r} (expected {MAGIC!r})", reply_possible=False)
    if hlen > limits.max_header_bytes:
        raise FrameError(f"header of {hlen} bytes exceeds the limit of {limits.max_header_bytes}")
    raw = _recv_exact(sock, hlen, "header", deadline=deadline, late=late("header", hlen))
    header = FrameHeader()
    try:
        header.ParseFromString(raw)
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
    scan = FiniteScan(layouts_from_pb(header.tensors)) if check_finite and check_finite(header) else None
    with Crc32Follower(payload, size, scan) as follower:
        got = 0
        while got < size:
            k = sock.recv_into(payload[got : got + chunk_bytes])
            if k == 0:
                raise FrameError(
                    f"peer closed mid-frame (payload: {got} of {size} bytes)", reply_possible=False
                )
            got += k
            follower.advance(got)  # on a helper thread for large payloads: beside the copy
            if bucket is not None:
                bucket.consume(k)
        if header.crc_trailer:
            trailer = _recv_exact(sock, _CRC.size, "CRC-32 trailer")
            (expected,) = _CRC.unpack(trailer)
        else:
            expected = header.payload_crc32
        crc = follower.result()
    end = time.time()
    if crc != expected:
        raise FrameError(
            f"CRC-32 mismatch on update {header.update_id!r}: sender says {expected:#010x}, "
            f"payload has {crc:#010x}"
        )
    header.payload_crc32, header.crc_trailer = crc, False  # verified: forward it without re-reading
    frame = Frame(header, payload, buffer, TransferStats(size, start, end))
    if scan is not None:
        frame.finite_checked, frame.non_finite = scan.done, scan.bad
    return frame
