"""Socket helpers of the data plane: ``"ip:port"`` addresses, socket options, I/O timeouts in the
kernel, a lingering close; and the accept loop and connection limit that the data-plane listener
and the local API share.

Split out of :mod:`mlfabric.daemon.channels.peers` (which re-exports :func:`parse_address` and
:func:`format_address`); its listener and peer pool use them on every connection.
"""

from __future__ import annotations

import contextlib
import math
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = [
    "accept_until_stopped",
    "admit",
    "format_address",
    "io_timeout",
    "lingering_close",
    "parse_address",
    "set_io_timeout",
    "set_receive_timeout",
    "start_accepting",
    "stop_accepting",
    "tune_socket",
]

_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"ip:port"`` (``"[v6]:port"`` too) into host and port.

    Examples
    --------
    >>> parse_address("127.0.0.1:7001")
    ('127.0.0.1', 7001)
    >>> parse_address("[::1]:80")
    ('::1', 80)
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {address!r}, expected 'ip:port'")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    """Join host and port into ``"ip:port"`` (``"[v6]:port"`` for IPv6).

    Examples
    --------
    >>> format_address("127.0.0.1", 7001)
    '127.0.0.1:7001'
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tune_socket(sock: socket.socket) -> None:
    """Data-plane socket options: no Nagle delay on headers and replies.

    Buffer sizes stay with the kernel's autotuning (setting ``SO_RCVBUF`` would switch it off).

    Examples
    --------
    >>> with socket.socket() as sock:
    ...     tune_socket(sock)
    ...     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    1
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _timeval(seconds: float | None) -> bytes:
    """``seconds`` as a ``struct timeval`` for ``SO_RCVTIMEO``/``SO_SNDTIMEO`` (all zero: no limit)."""
    if seconds is None or math.isinf(seconds):
        return _TIMEVAL.pack(0, 0)
    micros = max(1, round(seconds * 1e6))  # zero would mean "no limit"
    return _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000)


def set_io_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bound each send and receive call on ``sock`` by ``seconds`` (None: no bound), without polls.

    A plain socket is put in blocking mode with the bound kept by the kernel (``SO_RCVTIMEO``,
    ``SO_SNDTIMEO``): CPython then calls ``recv``/``send`` directly instead of polling before
    each call, as it does on a socket with a Python timeout. A call that times out fails with
    ``BlockingIOError`` (``EAGAIN``) instead of ``TimeoutError``; the framing functions turn it
    into a ``TimeoutError`` naming the bound. A TLS socket keeps a Python timeout (its reads
    would retry a kernel timeout forever).

    Examples
    --------
    >>> a, b = socket.socketpair()
    >>> set_io_timeout(a, 0.1)
    >>> a.gettimeout(), io_timeout(a)
    (None, 0.1)
    >>> try:
    ...     a.recv(1)
    ... except BlockingIOError:
    ...     print("timed out")
    timed out
    >>> a.close(); b.close()
    """
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(None if seconds is None or math.isinf(seconds) else seconds)
        return
    sock.settimeout(None)
    value = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def io_timeout(sock: socket.socket) -> float | None:
    """The bound on each receive call of ``sock`` in seconds (None: none); see :func:`set_io_timeout`.

    A plain socket that still has a Python timeout is switched to the kernel's, with the same
    bound, first: from then on no poll precedes its calls.

    Examples
    --------
    >>> a, b = socket.socketpair()
    >>> a.settimeout(2.5)
    >>> io_timeout(a), a.gettimeout()
    (2.5, None)
    >>> a.close(); b.close()
    """
    python = sock.gettimeout()
    if isinstance(sock, ssl.SSLSocket):
        return python
    if python is not None:
        set_io_timeout(sock, python)
        return python
    sec, usec = _TIMEVAL.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.size))
    return None if sec == usec == 0 else sec + usec / 1e6


def set_receive_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bound the next receive calls of ``sock`` (set up by :func:`set_io_timeout`) by ``seconds``.

    For a frame's phases: its first byte (the idle timeout), its header (the header timeout),
    then back to the I/O timeout for its payload.
    """
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(None if seconds is None or math.isinf(seconds) else seconds)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def lingering_close(
    sock: socket.socket, seconds: float = 1.0, max_bytes: int = 1 << 20, total_seconds: float = 10.0
) -> None:
    """Stop writing and discard what the peer still sends for a moment before closing.

    Closing a socket with unread input makes the kernel send RST, which can destroy the ERROR
    frame just written before the peer reads it. The caller closes ``sock`` afterwards.

    Parameters
    ----------
    sock : socket.socket
        A connected stream socket.
    seconds : float
        How long one read of the peer's remaining bytes may wait.
    max_bytes : int
        Stop discarding after this many bytes.
    total_seconds : float
        How long the whole discarding may take (a peer trickling bytes cannot hold it longer).

    Examples
    --------
    >>> a, b = socket.socketpair()
    >>> b.sendall(b"unread bytes")
    >>> b.shutdown(socket.SHUT_WR)
    >>> lingering_close(a)   # reads until the peer's end of stream
    >>> b.recv(16)           # the peer sees ours
    b''
    >>> a.close(); b.close()
    """
    deadline = time.monotonic() + total_seconds
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        drained = 0
        while drained < max_bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sock.settimeout(min(seconds, remaining))
            chunk = sock.recv(65536)
            if not chunk:
                break
            drained += len(chunk)


def accept_until_stopped(
    server: socket.socket, stopping: threading.Event, handle: Callable[[socket.socket, Any], None]
) -> None:
    """Accept connections on ``server`` and pass each to ``handle`` until ``stopping`` is set.

    An accept failing after ``stopping`` was set (the listening socket was shut down) ends
    the loop; one failing before it is raised.

    Examples
    --------
    >>> server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    >>> server.bind(("127.0.0.1", 0)); server.listen(1)
    >>> stopping = threading.Event()
    >>> client = socket.create_connection(server.getsockname())
    >>> def handle(sock, peer):
    ...     sock.close()
    ...     stopping.set()
    >>> accept_until_stopped(server, stopping, handle)
    >>> client.close(); server.close()
    """
    while not stopping.is_set():
        try:
            sock, peer = server.accept()
        except OSError:
            if stopping.is_set():
                return
            raise
        handle(sock, peer)


def start_accepting(
    server: socket.socket, stopping: threading.Event, handle: Callable[[socket.socket, Any], None], name: str
) -> threading.Thread:
    """Run :func:`accept_until_stopped` on a daemon thread named ``name``; the thread, started."""
    thread = threading.Thread(
        target=accept_until_stopped, args=(server, stopping, handle), name=name, daemon=True
    )
    thread.start()
    return thread


def stop_accepting(
    server: socket.socket | None, stopping: threading.Event, thread: threading.Thread | None, timeout: float
) -> None:
    """End what :func:`start_accepting` started: set ``stopping``, shut ``server`` down and close
    it (a blocked ``accept`` returns), join ``thread`` (``None``: nothing to close or join)."""
    stopping.set()
    if server is not None:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()
    if thread is not None:
        thread.join(timeout)


def admit(conns: MutableMapping[K, V], key: K, value: V, max_connections: int | None) -> bool:
    """Add a connection to ``conns`` unless it holds ``max_connections`` already.

    The caller holds the lock guarding ``conns``, and refuses the connection when this is False.

    Examples
    --------
    >>> conns = {}
    >>> admit(conns, 1, "a", 1), admit(conns, 2, "b", 1), admit(conns, 2, "b", None)
    (True, False, True)
    >>> sorted(conns)
    [1, 2]
    """
    if max_connections is not None and len(conns) >= max_connections:
        return False
    conns[key] = value
    return True
