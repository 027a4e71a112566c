"""Data-plane transport: the pool of connections to peer daemons.

The listener those connections reach is :mod:`mlfabric.daemon.channels.listener`.

NOTE (after the API was published, 05:45 UTC; signatures unchanged): ``is_stale`` no longer blocks
(so ``PeerPool.request`` reuse is safe); a raising handler gets ERROR sent back and its connection
kept; ``PeerPool.request`` closes a connection whose reply was ERROR.

A small "Van"-style interface (connect, send, receive) over blocking TCP sockets and threads, so a
daemon can move an update to its next hop (a peer daemon: the server's, or an aggregator's,
MLfabric §4) with one call::

    reply = pool.request("127.0.0.1:7001", header, FileSpan(fd, 0, n), crc32=crc)

Request/reply pairs: UPDATE -> ACK, GET -> MODEL (either may be answered with ERROR).
:class:`PeerPool` never resends a frame by itself (a resend could apply an update twice):
:class:`PeerUnavailable` says whether the request may have arrived, and the daemon retries or
resolves the push DROPPED.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from mlfabric.daemon.channels.frames import (
    Alloc,
    Frame,
    FrameError,
    FrameLimits,
    Payload,
    TransferStats,
    recv_frame,
    send_frame,
)
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.daemon.channels.sockets import format_address, parse_address, tune_socket
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.auth import AuthFailed, DataPlaneAuth

__all__ = [
    "Connection",
    "PeerPool",
    "PeerUnavailable",
    "Reply",
    "format_address",
    "parse_address",
    "wire_timing",
]

_LOG = logging.getLogger("mlfabric.daemon.channels.peers")


def wire_timing(
    nbytes: int, start: float, send_seconds: float, receive_seconds: float
) -> tuple[float, float, float]:
    """Start, end and throughput of a transfer as the wire saw it.

    The sender's clock stops when the kernel took the last byte, which socket buffers can
    make far shorter than the transfer (a 1 MB update on a 50 Mbit/s link "sent" at
    6.7 Gbit/s); the receiver times its first to last byte and returns that in the ACK.
    The longer of the two is the transfer's duration, so bandwidth estimates follow the
    link, not the local socket.

    Examples
    --------
    >>> wire_timing(1_000_000, 100.0, 0.001, 0.16)
    (100.0, 100.16, 6250000.0)
    """
    seconds = max(send_seconds, receive_seconds)
    throughput = nbytes / seconds if seconds > 0 and nbytes > 0 else 0.0
    return start, start + seconds, throughput


class PeerUnavailable(ConnectionError):
    """A peer daemon could not be reached, or went away during a transfer.

    Parameters
    ----------
    address : str
        The peer's ``"ip:port"``.
    reason : str
        What happened (``"connect: [Errno 111] Connection refused"``, ``"peer closed mid-frame"``...).
    sent : bool
        True if the request frame may have reached the peer completely (so it may have been
        applied; a resend must be idempotent on the receiving side).

    Examples
    --------
    >>> str(PeerUnavailable("127.0.0.1:9", "connect: refused"))
    'peer 127.0.0.1:9 unavailable: connect: refused'
    """

    def __init__(self, address: str, reason: str, *, sent: bool = False) -> None:
        super().__init__(f"peer {address} unavailable: {reason}")
        self.address = address
        self.reason = reason
        self.sent = sent


@dataclass
class Reply:
    """The peer's answer to :meth:`Connection.request`.

    Parameters
    ----------
    header : FrameHeader
        ACK, MODEL or ERROR header.
    payload : memoryview
        The reply's payload (empty for ACK / ERROR).
    buffer : object or None
        What ``alloc`` returned for the payload (None when empty).
    sent : TransferStats
        The request's payload bytes, start and end (the transfer to report, MLfabric §4).
    received : TransferStats
        The reply's payload bytes, start and end.
    """

    header: Any
    payload: memoryview
    buffer: Any
    sent: TransferStats
    received: TransferStats


class Connection:
    """One TCP connection to a peer daemon, used by one thread at a time.

    Parameters
    ----------
    address : str
        The peer's ``"ip:port"`` (for error messages).
    sock : socket.socket
        The connected socket; the connection owns it from now on.
    limits : FrameLimits
        Limits applied to replies.
    egress_bucket, ingress_bucket : TokenBucket, optional
        Rate limits shared with the daemon's other connections.
    """

    def __init__(
        self,
        address: str,
        sock: socket.socket,
        limits: FrameLimits,
        egress_bucket: TokenBucket | None = None,
        ingress_bucket: TokenBucket | None = None,
    ) -> None:
        self.address = address
        self._sock = sock
        self._limits = limits
        self._egress = egress_bucket
        self._ingress = ingress_bucket
        self.closed = False
        #: monotonic time the connection was last given back to its pool
        self.idle_since = time.monotonic()

    def send(self, header: Any, payload: Payload | None = None, *, crc32: int | None = None) -> TransferStats:
        """Send one frame (see :func:`~mlfabric.daemon.channels.frames.send_frame`).

        Raises
        ------
        PeerUnavailable
            The socket failed; the connection is closed.
        """
        try:
            return send_frame(self._sock, header, payload, crc32=crc32, bucket=self._egress)
        except OSError as exc:
            self.close()
            raise PeerUnavailable(self.address, f"send failed: {exc!r}") from exc

    def receive(self, alloc: Alloc = bytearray) -> Frame:
        """Receive one frame (see :func:`~mlfabric.daemon.channels.frames.recv_frame`).

        Raises
        ------
        PeerUnavailable
            The peer closed, the socket failed or the frame was malformed; the connection is
            closed.
        """
        try:
            frame = recv_frame(self._sock, self._limits, alloc, bucket=self._ingress)
        except (OSError, FrameError) as exc:
            self.close()
            raise PeerUnavailable(self.address, f"receive failed: {exc}", sent=True) from exc
        if frame is None:
            self.close()
            raise PeerUnavailable(self.address, "peer closed the connection before replying", sent=True)
        return frame

    def request(
        self,
        header: Any,
        payload: Payload | None = None,
        *,
        crc32: int | None = None,
        alloc: Alloc = bytearray,
    ) -> Reply:
        """Send a frame and wait for the peer's reply (UPDATE -> ACK, GET -> MODEL, or ERROR).

        Parameters
        ----------
        header : FrameHeader
            UPDATE or GET header (``payload_bytes`` and the CRC are filled in).
        payload : bytes-like or FileSpan, optional
            The update's tensors (a memfd as a :class:`~mlfabric.daemon.channels.frames.FileSpan`).
        crc32 : int, optional
            The payload's CRC-32 if already known (else computed while sending).
        alloc : callable
            Allocator for the reply's payload (MODEL).

        Returns
        -------
        Reply
            The reply frame and the measurements of both directions.

        Raises
        ------
        PeerUnavailable
            The peer could not be reached or vanished; ``sent`` says whether the request got out.
        """
        sent = self.send(header, payload, crc32=crc32)
        frame = self.receive(alloc)
        return Reply(frame.header, frame.payload, frame.buffer, sent, frame.stats)

    def is_stale(self) -> bool:
        """Whether the peer closed this idle connection (or sent something nobody asked for).

        An idle connection has nothing to read; readable means EOF, RST or stray bytes, and in
        every one of those cases the connection must not carry another request.
        """
        if self.closed:
            return True
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()


class PeerPool:
    """Connections to peer daemons by ``"ip:port"``, reused between requests.

    Parameters
    ----------
    limits : FrameLimits
        Limits applied to replies.
    egress_bucket, ingress_bucket : TokenBucket, optional
        The daemon's shared rate limits (None: unlimited).
    connect_timeout : float
        Seconds to wait for a TCP connect.
    io_timeout : float or None
        Seconds any single send/receive call may block (None: forever).
    max_idle_per_peer : int
        Idle connections kept per address.
    max_idle_seconds : float or None
        An idle connection older than this is closed instead of reused (keep it below the
        peers' ``idle_timeout``, so a request never goes out on a connection the peer is closing).
    auth : DataPlaneAuth, optional
        Authenticate each new connection before its first frame (:mod:`mlfabric.wire.auth`).

    Examples
    --------
    >>> pool = PeerPool(FrameLimits(), connect_timeout=1.0)
    >>> pool.request("127.0.0.1:1", error_header("x"))  # doctest: +SKIP
    Traceback (most recent call last):
    PeerUnavailable: peer 127.0.0.1:1 unavailable: connect: ...
    >>> pool.close()
    """

    def __init__(
        self,
        limits: FrameLimits,
        egress_bucket: TokenBucket | None = None,
        ingress_bucket: TokenBucket | None = None,
        *,
        connect_timeout: float = 5.0,
        io_timeout: float | None = 60.0,
        max_idle_per_peer: int = 4,
        max_idle_seconds: float | None = None,
        auth: DataPlaneAuth | None = None,
    ) -> None:
        self._limits = limits
        self._auth = auth if auth is not None and auth.enabled else None
        self._max_idle_seconds = max_idle_seconds
        self._egress = egress_bucket
        self._ingress = ingress_bucket
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._max_idle = max_idle_per_peer
        self._lock = threading.Lock()
        self._idle: dict[str, list[Connection]] = {}
        self._closed = False

    def connect(self, address: str) -> Connection:
        """Open a new connection to ``address`` (not pooled; the caller closes it).

        Raises
        ------
        PeerUnavailable
            Connection refused, unreachable or timed out.
        """
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except OSError as exc:
            raise PeerUnavailable(address, f"connect: {exc}") from exc
        tune_socket(sock)
        if self._auth is not None:
            try:
                sock = self._auth.connect(sock)
            except AuthFailed as exc:
                sock.close()
                raise PeerUnavailable(address, f"authentication: {exc.reason}") from exc
        sock.settimeout(self._io_timeout)
        return Connection(address, sock, self._limits, self._egress, self._ingress)

    def acquire(self, address: str) -> Connection:
        """An idle live connection to ``address``, or a new one."""
        with self._lock:
            if self._closed:
                raise RuntimeError("PeerPool is closed")
            idle = self._idle.get(address, [])
            while idle:
                conn = idle.pop()
                too_old = (
                    self._max_idle_seconds is not None
                    and time.monotonic() - conn.idle_since > self._max_idle_seconds
                )
                if not too_old and not conn.is_stale():
                    return conn
                conn.close()
        return self.connect(address)

    def release(self, conn: Connection) -> None:
        """Give a healthy connection back for reuse (a closed one is dropped)."""
        if conn.closed:
            return
        with self._lock:
            idle = self._idle.setdefault(conn.address, [])
            if not self._closed and len(idle) < self._max_idle:
                conn.idle_since = time.monotonic()
                idle.append(conn)
                return
        conn.close()

    def request(
        self,
        address: str,
        header: Any,
        payload: Payload | None = None,
        *,
        crc32: int | None = None,
        alloc: Alloc = bytearray,
    ) -> Reply:
        """Send one frame to the daemon at ``address`` and return its reply.

        Parameters
        ----------
        address : str
            The peer daemon's data-plane ``"ip:port"``.
        header, payload, crc32, alloc
            As for :meth:`Connection.request` (UPDATE or GET; a memfd payload as a ``FileSpan``).

        Returns
        -------
        Reply
            Reply header/payload and the measured :class:`TransferStats` of both directions.

        Raises
        ------
        PeerUnavailable
            The peer is unreachable or vanished mid-transfer (``sent`` tells whether the request
            may have arrived). No automatic resend.
        """
        conn = self.acquire(address)
        try:
            reply = conn.request(header, payload, crc32=crc32, alloc=alloc)
        except BaseException:
            conn.close()
            raise
        if reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR:
            conn.close()  # the listener closes after rejecting a frame; do not race it
        else:
            self.release(conn)
        return reply

    def close(self) -> None:
        """Close every idle connection; later requests fail."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()
