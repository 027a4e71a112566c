"""Data-plane listener: the daemon's end that peer daemons connect to (MLfabric §4).

:class:`DataPlaneListener` accepts peer daemons' connections, one thread each, receives their
frames into buffers from its ``alloc`` and answers each with the :class:`Response` its
:data:`Handler` gives: UPDATE -> ACK, GET -> MODEL (either may be answered with ERROR). A frame
that breaks a rule is logged, answered with ERROR when the stream is still in step, and its
connection closed; every other connection carries on. The other end, the pool of connections to
peers, is :mod:`mlfabric.daemon.channels.peers`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from mlfabric.daemon.channels.frames import (
    Alloc,
    Frame,
    FrameError,
    FrameLimits,
    IdleTimeout,
    Payload,
    PayloadWatch,
    error_header,
    recv_frame,
    send_frame,
)
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.daemon.channels.sockets import (
    admit,
    format_address,
    lingering_close,
    parse_address,
    set_io_timeout,
    start_accepting,
    stop_accepting,
    tune_socket,
)
from mlfabric.wire.auth import AuthFailed, DataPlaneAuth

__all__ = ["DataPlaneListener", "Handler", "Response"]

#: the logger's name from before the listener had its own module (log filters keep working)
_LOG = logging.getLogger("mlfabric.daemon.transport")


@dataclass
class Response:
    """What a listener handler returns: the reply frame to send back.

    Parameters
    ----------
    header : FrameHeader
        ACK, MODEL or ERROR header.
    payload : bytes-like or FileSpan, optional
        The reply's payload (the model, for MODEL).
    crc32 : int, optional
        The payload's CRC-32 if already known.
    """

    header: Any
    payload: Payload | None = None
    crc32: int | None = None


#: ``handler(frame) -> Response``: the daemon's answer to one received frame. The frame's payload
#: buffer (from the listener's ``alloc``) belongs to the handler from then on. The handler may
#: raise; the listener then logs the exception with its traceback and answers ERROR.
Handler: TypeAlias = Callable[[Frame], Response]


class DataPlaneListener:
    """The daemon's TCP listener for peer daemons: one thread per connection.

    Parameters
    ----------
    bind_address : str
        ``"ip:port"`` to listen on (port 0: any free port; :meth:`start` returns the real one).
    handler : Handler
        ``handler(frame) -> Response``, called on the connection's thread.
    limits : FrameLimits
        What incoming frames may be.
    ingress_bucket, egress_bucket : TokenBucket, optional
        The daemon's shared rate limits for received frames and sent replies.
    alloc : callable
        Allocator for incoming payloads (the daemon passes memfd-backed mmaps).
    io_timeout : float or None
        Seconds a single receive/send of a payload or reply may block before the connection
        is dropped (None: no limit).
    idle_timeout : float or None
        Seconds a connection may wait between frames without sending a byte before it is
        closed (None: forever). Peers' pooled connections notice the close and reconnect.
    header_timeout : float or None
        Seconds from a frame's first byte until its whole header has arrived; a slower peer
        (e.g. one trickling the header byte by byte) is closed (None: no limit).
    max_connections : int or None
        Connections served at once; one more is answered with an ERROR frame naming the
        limit and closed (None: no limit).
    logger : logging.Logger, optional
        Where rejected frames and failures are logged.
    auth : DataPlaneAuth, optional
        Authenticate each connection before its first frame (:mod:`mlfabric.wire.auth`); a peer
        that does not is logged and closed, and a frame whose ``src_host`` is not a host the
        peer proved is refused with ERROR (None: no authentication).
    watch : callable, optional
        ``watch(header, payload)``: a watch on a frame's payload while it lands
        (:func:`~mlfabric.daemon.channels.frames.recv_frame`'s ``watch``; a pipelined
        aggregate's members); the handler still gets the frame once it is whole.

    Examples
    --------
    >>> listener = DataPlaneListener("127.0.0.1:0", lambda f: Response(error_header("no")), FrameLimits())
    >>> address = listener.start()   # doctest: +SKIP
    >>> listener.stop()
    """

    def __init__(
        self,
        bind_address: str,
        handler: Handler,
        limits: FrameLimits,
        ingress_bucket: TokenBucket | None = None,
        egress_bucket: TokenBucket | None = None,
        *,
        alloc: Alloc = bytearray,
        io_timeout: float | None = None,
        idle_timeout: float | None = None,
        header_timeout: float | None = None,
        max_connections: int | None = None,
        logger: logging.Logger | None = None,
        auth: DataPlaneAuth | None = None,
        watch: Callable[[Any, memoryview], PayloadWatch | None] | None = None,
    ) -> None:
        self._bind = parse_address(bind_address)
        self._watch = watch
        self._handler = handler
        self._limits = limits
        self._ingress = ingress_bucket
        self._egress = egress_bucket
        self._alloc = alloc
        self._io_timeout = io_timeout
        self._idle_timeout = idle_timeout
        self._header_timeout = header_timeout
        self._max_connections = max_connections
        self._auth = auth if auth is not None and auth.enabled else None
        self._log = logger or _LOG
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self.address: str | None = None
        #: Number of connections closed because of a bad frame (for tests and metrics).
        self.rejected = 0
        #: Connections closed for idling (``idle_timeout``) or refused over ``max_connections``.
        self.idle_closed = 0
        self.refused = 0
        #: Connections that did not authenticate, and frames refused for another host's name.
        self.auth_refused = 0

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._conns)

    def start(self) -> str:
        """Bind, listen and start accepting; return the bound ``"ip:port"``."""
        host, port = self._bind
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen(128)
        self._server = server
        bound = server.getsockname()
        self.address = format_address(bound[0], bound[1])
        self._accept_thread = start_accepting(
            server, self._stopping, self._accepted, f"dataplane-accept-{self.address}"
        )
        return self.address

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and join the threads (idempotent)."""
        server, self._server = self._server, None
        stop_accepting(server, self._stopping, self._accept_thread, timeout)
        with self._lock:
            conns = list(self._conns.items())
        for sock, _thread in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for _sock, thread in conns:
            thread.join(timeout)

    def _accepted(self, sock: socket.socket, peer: Any) -> None:
        tune_socket(sock)
        set_io_timeout(sock, self._io_timeout)
        name = f"{peer[0]}:{peer[1]}"
        thread = threading.Thread(target=self._serve, args=(sock, name), name="dataplane-conn", daemon=True)
        with self._lock:
            if self._stopping.is_set():
                sock.close()
                return
            full = not admit(self._conns, sock, thread, self._max_connections)
            if full:
                self.refused += 1
        if full:
            self._refuse(sock, name)
            return
        thread.start()

    def _refuse(self, sock: socket.socket, peer: str) -> None:
        """Answer a connection over ``max_connections`` with ERROR and close it (never blocks long)."""
        reason = f"too many data-plane connections (limit {self._max_connections}); try again later"
        self._log.warning("data plane: refused a connection from %s: %s", peer, reason)
        sock.settimeout(0.5)
        try:
            send_frame(sock, error_header(reason))
        except OSError as exc:
            self._log.info("data plane: could not send ERROR to %s: %r", peer, exc)
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        names: frozenset[str] | None = None
        try:
            if self._auth is not None:
                authenticated = self._authenticate(sock, peer)
                if authenticated is None:
                    return
                sock, names = authenticated
            self._serve_frames(sock, peer, names)
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _authenticate(self, sock: socket.socket, peer: str) -> tuple[socket.socket, frozenset[str]] | None:
        """The connection's (possibly TLS) socket and the hosts its peer proved; None: refused."""
        assert self._auth is not None
        try:
            wrapped, names = self._auth.accept(sock)
        except AuthFailed as exc:
            with self._lock:
                self.auth_refused += 1
            self._log.warning("data plane: refused the connection from %s: %s", peer, exc.reason)
            if exc.speaks_frames:
                self._reply_error(sock, peer, f"authentication required: {exc.reason}")
                lingering_close(sock)
            return None
        if wrapped is not sock:
            with self._lock:  # stop() shuts the connection down through the socket that owns it now
                thread = self._conns.pop(sock, None)
                if thread is not None:
                    self._conns[wrapped] = thread
        self._log.info("data plane: %s authenticated as %s", peer, ", ".join(sorted(names)))
        return wrapped, names

    def _wrong_host(self, frame: Frame, names: frozenset[str] | None, sock: socket.socket, peer: str) -> bool:
        """Refuse (ERROR, close) a frame sent in the name of a host its peer did not prove."""
        if not names:
            return False
        claimed = frame.header.src_host
        if not claimed:
            frame.header.src_host = min(names)
            return False
        if claimed in names:
            return False
        proved = ", ".join(sorted(names))
        reason = f"frame claims host {claimed!r} but the connection authenticated as {proved}"
        with self._lock:
            self.auth_refused += 1
        self._log.warning("data plane: refused a frame from %s: %s; closing", peer, reason)
        frame.release()
        self._reply_error(sock, peer, reason, frame.header.update_id)
        lingering_close(sock)
        return True

    def _serve_frames(self, sock: socket.socket, peer: str, names: frozenset[str] | None = None) -> None:
        while not self._stopping.is_set():
            try:
                frame = recv_frame(
                    sock,
                    self._limits,
                    self._alloc,
                    bucket=self._ingress,
                    idle_timeout=math.inf if self._idle_timeout is None else self._idle_timeout,
                    header_timeout=self._header_timeout,
                    watch=self._watch,
                )
            except IdleTimeout as exc:
                with self._lock:
                    self.idle_closed += 1
                self._log.info("data plane: closing the connection from %s: %s", peer, exc.reason)
                return
            except FrameError as exc:
                with self._lock:
                    self.rejected += 1
                self._log.warning("data plane: rejected frame from %s: %s; closing", peer, exc.reason)
                if exc.reply_possible:
                    self._reply_error(sock, peer, exc.reason)
                    lingering_close(sock)
                return
            except OSError as exc:
                if not self._stopping.is_set():
                    self._log.warning("data plane: connection from %s failed: %r", peer, exc)
                return
            if frame is None or self._wrong_host(frame, names, sock, peer):
                return
            try:
                response = self._handler(frame)
            except Exception as exc:
                logger = self._log
                logger.exception("data plane: handler failed on a frame from %s", peer)
                response = Response(
                    error_header(f"internal error: {exc!r}", update_id=frame.header.update_id)
                )
            try:
                send_frame(sock, response.header, response.payload, crc32=response.crc32, bucket=self._egress)
            except FrameError as exc:  # checked before any byte went out: the stream is in step
                self._log.error("data plane: handler's reply to %s is malformed: %s", peer, exc.reason)
                self._reply_error(
                    sock, peer, f"internal error: bad reply: {exc.reason}", frame.header.update_id
                )
            except OSError as exc:
                self._log.warning(
                    "data plane: reply to %s (update %r) failed: %r", peer, frame.header.update_id, exc
                )
                return

    def _reply_error(self, sock: socket.socket, peer: str, reason: str, update_id: str = "") -> None:
        try:
            send_frame(sock, error_header(reason, update_id=update_id))
        except OSError as exc:
            self._log.info("data plane: could not send ERROR to %s: %r", peer, exc)
