"""The daemon's local API server: a Unix stream socket for the training processes on its host.

Each connection carries one process's role (worker or server of one job). Messages are
length-prefixed ``LocalRequest``/``LocalEvent`` protobufs with tensor memfds passed as
SCM_RIGHTS (see :mod:`mlfabric.wire.framing`, the framing both ends share).
One reader thread per connection calls the daemon's ``on_request(conn, request, fd)``;
replies go out through :meth:`LocalConnection.send`, which any thread may call.

A message that does not parse is answered with a ``bad_request`` error and the connection
carries on; a message that breaks the framing (longer than the limit, a payload without a
descriptor) is answered and the connection closed. The daemon keeps running either way.

Limits against peers that hold connections open: a connection that has sent no message is
closed ``idle_timeout`` seconds after it was accepted (once a process has sent its first
message, e.g. its registration, it may stay quiet as long as it likes), a message must be
complete ``message_timeout`` seconds after its first byte, and at most ``max_connections``
connections are served at once (one more is answered with an ``unavailable`` error and
closed). Each closing is answered with a ``LocalError`` naming the limit.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from mlfabric.daemon.channels.sockets import admit, start_accepting, stop_accepting
from mlfabric.proto.v1 import local_pb2
from mlfabric.wire.framing import MAX_LOCAL_MESSAGE, MessageReader, ProtocolError, ReadTimeout, send_message
from mlfabric.wire.peercred import LocalAccess, peer_credentials

__all__ = ["LocalApiServer", "LocalConnection"]

_LOG = logging.getLogger("mlfabric.daemon.localapi")

_PAYLOAD_KINDS = ("push", "publish", "allreduce")


class LocalConnection:
    """One training process's connection; holds its role once registered.

    Attributes
    ----------
    conn_id : int
        Unique per daemon.
    role : str
        ``""``, ``"worker"`` or ``"server"``.
    job, name : str
        The role's job and name.
    """

    def __init__(self, conn_id: int, sock: socket.socket) -> None:
        self.conn_id = conn_id
        self._sock = sock
        self._write_lock = threading.Lock()
        self.role = ""
        self.job = ""
        self.name = ""
        self.closed = False

    def send(self, event: Any, fd: int | None = None) -> bool:
        """Send a ``LocalEvent`` (with ``fd`` passed if given); False if the process is gone."""
        if self.closed:
            return False
        try:
            with self._write_lock:
                send_message(self._sock, event, fd)
        except OSError as exc:
            _LOG.info("local connection %d: send failed: %r", self.conn_id, exc)
            return False
        return True

    def error(self, request_id: int, code: str, message: str) -> bool:
        """Answer ``request_id`` with a ``LocalError``."""
        return self.send(
            local_pb2.LocalEvent(
                request_id=request_id, error=local_pb2.LocalError(code=code, message=message)
            )
        )

    def close(self) -> None:
        """Shut the socket down (the reader thread then ends)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


RequestHandler = Callable[[LocalConnection, Any, "int | None"], None]


class LocalApiServer:
    """Accepts training processes on a Unix socket; one thread per connection.

    Parameters
    ----------
    path : str
        The socket path (its directory is created; a stale socket file is replaced).
    on_request : callable
        ``on_request(conn, request, fd)``: a parsed ``LocalRequest``; ``fd`` is the memfd passed
        with it (the handler owns it) or None.
    on_close : callable
        ``on_close(conn)``: the process disconnected.
    max_message : int
        Longest accepted message.
    idle_timeout : float, optional
        Seconds a new connection may stay without sending its first message (None: forever).
    message_timeout : float, optional
        Seconds from a message's first byte until it is complete (None: no limit).
    max_connections : int, optional
        Connections served at once (None: no limit).
    access : LocalAccess, optional
        Who may connect, checked with ``SO_PEERCRED`` (:mod:`mlfabric.wire.peercred`); anyone
        else is answered ``permission_denied`` naming why and closed (None: no check).
    """

    def __init__(
        self,
        path: str,
        on_request: RequestHandler,
        on_close: Callable[[LocalConnection], None],
        max_message: int = MAX_LOCAL_MESSAGE,
        *,
        idle_timeout: float | None = None,
        message_timeout: float | None = None,
        max_connections: int | None = None,
        access: LocalAccess | None = None,
    ) -> None:
        self.path = path
        self._access = access
        self._idle_timeout = idle_timeout
        self._message_timeout = message_timeout
        self._max_connections = max_connections
        #: connections refused over ``max_connections`` and closed by a timeout (tests, metrics)
        self.refused = 0
        self.timed_out = 0
        #: connections refused by ``access`` (SO_PEERCRED)
        self.denied = 0
        self._on_request = on_request
        self._on_close = on_close
        self._max = max_message
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[LocalConnection, threading.Thread]] = {}
        self._server: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Bind the socket and start accepting."""
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        server.listen(64)
        self._server = server
        self._accept_thread = start_accepting(server, self._stopping, self._accepted, "local-accept")

    def stop_accepting(self, timeout: float = 5.0) -> None:
        """Accept no new process (the socket file goes); the connections stay open."""
        server, self._server = self._server, None
        stop_accepting(server, self._stopping, self._accept_thread, timeout)
        if server is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, remove the socket file."""
        self.stop_accepting(timeout)
        with self._lock:
            conns = list(self._conns.values())
        for conn, _ in conns:
            conn.close()
        for _, thread in conns:
            thread.join(timeout)

    def _accepted(self, sock: socket.socket, _peer: Any) -> None:
        conn = LocalConnection(next(self._ids), sock)
        if self._access is not None:
            reason = self._access.refusal(peer_credentials(sock))
            if reason is not None:
                with self._lock:
                    self.denied += 1
                self._refuse(conn, sock, "permission_denied", reason)
                return
        thread = threading.Thread(
            target=self._serve, args=(conn, sock), name=f"local-{conn.conn_id}", daemon=True
        )
        with self._lock:
            full = not admit(self._conns, conn.conn_id, (conn, thread), self._max_connections)
            if full:
                self.refused += 1
        if full:
            reason = f"too many local connections to this daemon (limit {self._max_connections})"
            self._refuse(conn, sock, "unavailable", reason)
            return
        thread.start()

    def _refuse(self, conn: LocalConnection, sock: socket.socket, code: str, reason: str) -> None:
        """Answer a connection refused (over ``max_connections``, not allowed) and close it."""
        _LOG.warning("local connection %d refused: %s", conn.conn_id, reason)
        sock.settimeout(0.5)  # a fresh socket's buffer takes the error; never block the accept loop
        conn.error(0, code, reason)
        conn.close()
        sock.close()

    def _serve(self, conn: LocalConnection, sock: socket.socket) -> None:
        reader = MessageReader(sock, self._max)
        try:
            self._read_requests(conn, reader)
        except OSError as exc:
            if not self._stopping.is_set():
                _LOG.info("local connection %d failed: %r", conn.conn_id, exc)
        finally:
            conn.closed = True
            reader.close()
            with self._lock:
                self._conns.pop(conn.conn_id, None)
            try:
                self._on_close(conn)
            finally:
                sock.close()

    def _read_requests(self, conn: LocalConnection, reader: MessageReader) -> None:
        first = True
        while not self._stopping.is_set():
            try:
                body = reader.read(
                    idle_timeout=self._idle_timeout if first else None,
                    message_timeout=self._message_timeout,
                )
            except ReadTimeout as exc:
                with self._lock:
                    self.timed_out += 1
                _LOG.warning("local connection %d: %s; closing it", conn.conn_id, exc)
                conn.error(0, "timeout", f"{exc}; closing the connection")
                return
            except ProtocolError as exc:
                _LOG.warning("local connection %d: %s; closing it", conn.conn_id, exc)
                conn.error(0, "bad_request", f"{exc}; closing the connection")
                return
            if body is None:
                return
            try:
                request = local_pb2.LocalRequest.FromString(body)
            except DecodeError as exc:
                _LOG.warning("local connection %d: malformed message (%s)", conn.conn_id, exc)
                conn.error(0, "bad_request", f"malformed local message ({len(body)} bytes): {exc}")
                continue
            first = False
            kind = request.WhichOneof("kind")
            fd = None
            if kind in _PAYLOAD_KINDS and getattr(request, kind).has_payload:
                try:
                    fd = reader.take_fd()
                except ProtocolError as exc:
                    conn.error(request.request_id, "bad_request", f"{kind}: {exc}; closing the connection")
                    return
            self._on_request(conn, request, fd)
