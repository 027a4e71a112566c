"""The local API's framing: how a training process and its host's daemon talk (DESIGN §3).

Messages travel over a Unix stream socket as a 4-byte big-endian length followed by a
serialized ``LocalRequest`` (process -> daemon) or ``LocalEvent`` (daemon -> process),
``proto/mlfabric/v1/local.proto``. Tensor bytes never travel in a message: they sit in
a memfd (:mod:`mlfabric.wire.memfd`) whose descriptor rides on the same ``sendmsg`` as
SCM_RIGHTS ancillary data, and the message says so with ``has_payload``. The kernel hands
ancillary data out with the first byte of the write that carried it, so descriptors arrive
in message order; :class:`MessageReader` queues them and each payload-carrying message
takes the next.

Both ends import this module: the client (:mod:`mlfabric.localclient`) and the daemon
(:mod:`mlfabric.daemon.channels.localapi`). It also says where the daemon's socket is
(:func:`default_socket_path`).
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
import tempfile
import time
from typing import Any

__all__ = [
    "DEFAULT_SOCKET",
    "ENV_DAEMON",
    "MAX_LOCAL_MESSAGE",
    "MessageReader",
    "ProtocolError",
    "ReadTimeout",
    "default_socket_path",
    "send_message",
]

#: Environment variable naming the daemon's socket.
ENV_DAEMON = "MLFABRIC_DAEMON"

#: The socket path used when neither an argument nor ``MLFABRIC_DAEMON`` names one.
DEFAULT_SOCKET = os.path.join(tempfile.gettempdir(), f"mlfabric-{os.getuid()}", "daemon.sock")

#: Largest local message (the protobuf, not the tensors, which go in a memfd).
MAX_LOCAL_MESSAGE = 16 << 20

_LEN = struct.Struct(">I")
_MAX_FDS = 16


class ProtocolError(ValueError):
    """A local message that breaks the framing (too long, or a payload without a descriptor)."""


class ReadTimeout(ProtocolError):
    """No message began within the idle timeout, or one began and did not finish in time."""


def default_socket_path(explicit: str | None = None) -> str:
    """The daemon socket to use: ``explicit``, else ``$MLFABRIC_DAEMON``, else :data:`DEFAULT_SOCKET`.

    Parameters
    ----------
    explicit : str, optional
        A path given by the caller.

    Returns
    -------
    str

    Examples
    --------
    >>> default_socket_path("/tmp/x.sock")
    '/tmp/x.sock'
    """
    return explicit or os.environ.get(ENV_DAEMON) or DEFAULT_SOCKET


def send_message(sock: socket.socket, message: Any, fd: int | None = None) -> None:
    """Write one length-prefixed message, with ``fd`` (if any) as SCM_RIGHTS on the same write.

    Parameters
    ----------
    sock : socket.socket
        A connected Unix stream socket. Callers serialise writes (one writer at a time).
    message : LocalRequest or LocalEvent
        The protobuf message.
    fd : int, optional
        A descriptor to pass (the receiver gets its own copy; the caller still owns ``fd``).
    """
    body = message.SerializeToString()
    data = _LEN.pack(len(body)) + body
    if fd is None:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], [fd])
    if sent < len(data):
        sock.sendall(data[sent:])


class MessageReader:
    """Reads length-prefixed messages and the descriptors passed with them from one socket.

    Parameters
    ----------
    sock : socket.socket
        A connected Unix stream socket.
    max_message : int
        Messages longer than this raise :class:`ProtocolError`.
    """

    def __init__(self, sock: socket.socket, max_message: int = MAX_LOCAL_MESSAGE) -> None:
        self._sock = sock
        self._max = max_message
        self._buf = bytearray()
        self._fds: collections.deque[int] = collections.deque()

    def read(self, idle_timeout: float | None = None, message_timeout: float | None = None) -> bytes | None:
        """The next message's bytes, or None at end of stream.

        Parameters
        ----------
        idle_timeout : float, optional
            Seconds to wait for a message's first byte (None: forever).
        message_timeout : float, optional
            Seconds from a message's first byte (or from this call, when a piece of it was
            already buffered) until it is complete (None: no limit): a peer sending a
            message byte by byte is cut off.

        Raises
        ------
        ProtocolError
            When the length prefix exceeds the limit.
        ReadTimeout
            When a timeout expired (the message names which).
        OSError
            When the socket fails.
        """
        started = time.monotonic() if self._buf else None
        while True:
            if len(self._buf) >= _LEN.size:
                (length,) = _LEN.unpack_from(self._buf)
                if length > self._max:
                    raise ProtocolError(f"local message of {length} bytes exceeds the {self._max}-byte limit")
                if len(self._buf) >= _LEN.size + length:
                    body = bytes(self._buf[_LEN.size : _LEN.size + length])
                    del self._buf[: _LEN.size + length]
                    return body
            if started is None and idle_timeout is not None and not self._readable(idle_timeout):
                raise ReadTimeout(f"no local message for {idle_timeout:g} s (idle timeout)")
            if started is not None and message_timeout is not None:
                remaining = started + message_timeout - time.monotonic()
                if not self._readable(remaining):
                    raise ReadTimeout(
                        f"local message not complete within {message_timeout:g} s "
                        f"({len(self._buf)} bytes received; message timeout)"
                    )
            data, fds, _flags, _addr = socket.recv_fds(self._sock, 1 << 16, _MAX_FDS)
            self._fds.extend(fds)
            if not data:
                return None
            if started is None:
                started = time.monotonic()
            self._buf += data

    def _readable(self, seconds: float) -> bool:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(max(0, int(seconds * 1000) + 1) if seconds > 0 else 0))

    def take_fd(self) -> int:
        """The descriptor passed with the message just read (the caller owns it).

        Raises
        ------
        ProtocolError
            When no descriptor came with the message.
        """
        if not self._fds:
            raise ProtocolError("message says has_payload but no file descriptor came with it")
        return self._fds.popleft()

    def close(self) -> None:
        """Close descriptors received but never taken."""
        while self._fds:
            os.close(self._fds.popleft())
