"""The daemon's peers: connections to peer daemons, and the one way a frame goes out to them.

The listener those connections reach is :mod:`mlfabric.daemon.channels.listener`.

A small "Van"-style interface (connect, send, receive) over blocking TCP sockets and threads, so a
daemon can move an update to its next hop (a peer daemon: the server's, or an aggregator's,
MLfabric §4) with one call::

    reply = pool.request("127.0.0.1:7001", header, FileSpan(fd, 0, n), crc32=crc)
    delivery = pool.deliver("127.0.0.1:7001", header, FileSpan(fd, 0, n), crc32=crc)

Request/reply pairs: UPDATE -> ACK, GET -> MODEL (either may be answered with ERROR; a
connection whose reply was ERROR is closed, not pooled). :meth:`PeerPool.request` is one
attempt; :meth:`PeerPool.deliver` is the daemon's one retry loop and owns the exactly-once rule
of sending (DESIGN §10): a peer that certainly got nothing is retried with backoff, a frame that
may have arrived (:class:`PeerUnavailable` with ``sent``) is never sent again and its outcome is
UNKNOWN. Both are cut by :meth:`PeerPool.stop`. The workers' pushes and the aggregator's
forwards deliver through it; the all-reduce chunks, replication entries and model fetches
request through it.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
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
from mlfabric.daemon.channels.payloadio import release_payload
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.daemon.channels.sockets import format_address, parse_address, set_io_timeout, tune_socket
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.auth import AuthFailed, DataPlaneAuth
from mlfabric.wire.memfd import PooledBuffer, allocate

__all__ = [
    "Connection",
    "Delivery",
    "PeerPool",
    "PeerUnavailable",
    "Reply",
    "format_address",
    "parse_address",
    "wire_timing",
]

_LOG = logging.getLogger("mlfabric.daemon.transport")


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

    def release(self) -> None:
        """Done with the reply's payload: drop the view and give its buffer back. Idempotent."""
        release_payload(self.payload, self.buffer)

    def memfd(self) -> PooledBuffer:
        """The reply's payload as a memfd the caller releases (its view released; empty: a new one).

        For a reply received with ``alloc=mlfabric.wire.memfd.allocate`` (a fetched model,
        whose fd goes on to a local process).
        """
        buffer = self.buffer if isinstance(self.buffer, PooledBuffer) else allocate(0)
        self.payload.release()
        return buffer

    def timing(self) -> tuple[float, float, float]:
        """Start, end and throughput of the request's transfer (:func:`wire_timing`)."""
        return wire_timing(self.sent.bytes, self.sent.start, self.sent.seconds, self.header.receive_seconds)


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


@dataclass
class Delivery:
    """What :meth:`PeerPool.deliver` got from a peer: its reply, or why there is none.

    Parameters
    ----------
    address : str
        The peer's ``"ip:port"``.
    attempts : int
        The attempts allowed (named in :meth:`failed_reason`).
    reply : Reply or None
        The peer's reply (ACK, MODEL or ERROR), or None when no attempt got one.
    errors : list of str
        Why each failed attempt failed, in order.
    maybe_sent : bool
        The last attempt may have reached the peer whole before it went away: it may have been
        applied there, so it was not sent again and its outcome is UNKNOWN (DESIGN §10).
    maybe_arrived : bool
        Some attempt may have reached the peer whole and got no answer: :attr:`maybe_sent`,
        or an attempt sent again because the peer de-duplicates it (``may_resend``, an
        aggregator's member: it may be summed there even if a later attempt got an ERROR).

    Examples
    --------
    >>> d = Delivery("10.0.0.9:7000", 3, None, ["receive failed: reset"], maybe_sent=True)
    >>> d.unknown_reason("h/1", "ps")
    "h/1 may have reached host 'ps' (10.0.0.9:7000), which gave no verdict: receive failed: reset"
    >>> Delivery("10.0.0.9:7000", 3, None, ["connect: refused"]).failed_reason("transfer of h/1", "ps")
    "transfer of h/1 to host 'ps' (10.0.0.9:7000) failed after 3 attempts: connect: refused"
    """

    address: str
    attempts: int
    reply: Reply | None = None
    errors: list[str] = field(default_factory=list)
    maybe_sent: bool = False
    maybe_arrived: bool = False

    @property
    def last_error(self) -> str:
        """Why the last attempt failed (``"no attempt"`` when none was made)."""
        return self.errors[-1] if self.errors else "no attempt"

    def unknown_reason(self, what: str, host: str) -> str:
        """The UNKNOWN reason of ``what`` when :attr:`maybe_sent`: it may be applied at ``host``."""
        where = f"host {host!r} ({self.address})"
        return f"{what} may have reached {where}, which gave no verdict: {self.last_error}"

    def failed_reason(self, what: str, host: str) -> str:
        """Why ``what`` did not reach ``host`` when no attempt got a reply (certainly not applied)."""
        return (
            f"{what} to host {host!r} ({self.address}) failed after {self.attempts} attempts: "
            f"{self.last_error}"
        )


class PeerPool:
    """Connections to peer daemons by ``"ip:port"``, reused between requests; the one way out.

    :meth:`request` sends one frame and returns the reply; :meth:`deliver` retries a peer that
    got nothing with exponential backoff and never resends a frame that may have arrived (the
    maybe-sent rule, DESIGN §10). :meth:`stop` cuts the requests in flight (they fail at once,
    not at their I/O timeout) and refuses new ones.

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
    send_attempts : int
        Tries per :meth:`deliver`.
    retry_backoff : float
        Seconds before :meth:`deliver`'s first retry, doubling per retry.

    Examples
    --------
    >>> from mlfabric.daemon.channels.frames import error_header
    >>> pool = PeerPool(FrameLimits(), connect_timeout=1.0, send_attempts=2, retry_backoff=0.0)
    >>> d = pool.deliver("127.0.0.1:1", error_header("x"))   # nothing listens there
    >>> d.reply is None, d.maybe_sent, len(d.errors)
    (True, False, 2)
    >>> pool.stop("daemon of host 'w0' is stopping"); pool.close()
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
        send_attempts: int = 3,
        retry_backoff: float = 0.2,
    ) -> None:
        self._limits = limits
        self._auth = auth if auth is not None and auth.enabled else None
        self._max_idle_seconds = max_idle_seconds
        self._egress = egress_bucket
        self._ingress = ingress_bucket
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._max_idle = max_idle_per_peer
        self.send_attempts = max(1, send_attempts)
        self.retry_backoff = retry_backoff
        self._lock = threading.Lock()
        self._idle: dict[str, list[Connection]] = {}
        self._active: set[Connection] = set()
        self._closed = False
        self._stopping = threading.Event()
        self._stop_reason = "stopping"

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
        set_io_timeout(sock, self._io_timeout)
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
        """Send one frame to the daemon at ``address`` and return its reply (one attempt).

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
            may have arrived), or the pool is stopping. No automatic resend.
        """
        if self._stopping.is_set():
            raise PeerUnavailable(address, self._stop_reason)
        conn = self.acquire(address)
        with self._lock:
            self._active.add(conn)
        try:
            reply = conn.request(header, payload, crc32=crc32, alloc=alloc)
        except BaseException:
            conn.close()
            raise
        finally:
            with self._lock:
                self._active.discard(conn)
        if reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR:
            conn.close()  # the listener closes after rejecting a frame; do not race it
        else:
            self.release(conn)
        return reply

    def deliver(
        self,
        address: str,
        header: Any,
        payload: Payload | None = None,
        *,
        crc32: int | None = None,
        may_resend: bool = False,
    ) -> Delivery:
        """Send one frame until the peer answers, at most ``send_attempts`` times (DESIGN §10).

        A peer that certainly got nothing (refused, unreachable, gone before the whole frame
        went out) is tried again after a backoff (``retry_backoff``, doubling). A frame that
        may have reached the peer whole (:class:`PeerUnavailable` with ``sent``) may have been
        applied there, and a resend could reach a restarted daemon that cannot know: it is
        never sent again and the delivery says :attr:`Delivery.maybe_sent` (its outcome is
        UNKNOWN) — unless ``may_resend``: the peer answers a repeated frame without applying
        it twice (an aggregator's member). :meth:`stop` ends the attempts ("daemon shutting
        down").

        Returns
        -------
        Delivery
            The reply, or the errors and whether the frame may have arrived. Never raises for
            the peer's sake.
        """
        delivery = Delivery(address, self.send_attempts)
        for attempt in range(self.send_attempts):
            if attempt and self._stopping.wait(self.retry_backoff * 2 ** (attempt - 1)):
                delivery.errors.append("daemon shutting down")
                break
            try:
                delivery.reply = self.request(address, header, payload, crc32=crc32)
                return delivery
            except PeerUnavailable as exc:
                _LOG.warning(
                    "%s to %s, attempt %d/%d: %s",
                    header.update_id or "frame",
                    address,
                    attempt + 1,
                    self.send_attempts,
                    exc,
                )
                delivery.errors.append(str(exc))
                delivery.maybe_arrived = delivery.maybe_arrived or exc.sent
                if exc.sent and not may_resend:
                    delivery.maybe_sent = True
                    break
        return delivery

    def stop(self, reason: str = "stopping") -> None:
        """Cut the requests in flight (they fail now) and refuse new ones with ``reason``."""
        self._stop_reason = reason
        self._stopping.set()
        with self._lock:
            active = list(self._active)
        for conn in active:
            conn.close()

    def close(self) -> None:
        """Close every idle connection; later requests fail."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()
