"""The training-process end of the local API: a connection to its host's daemon (DESIGN §3, §7).

:class:`LocalClient` sends ``LocalRequest`` messages and reads ``LocalEvent`` messages with
the framing of :mod:`mlfabric.wire.framing` (shared with the daemon's
:mod:`mlfabric.daemon.channels.localapi`); tensor bytes go in a memfd passed alongside.
:class:`PushHandle` / :class:`PushResult` are how a push's outcome (APPLIED or DROPPED)
comes back to it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlfabric.proto.v1 import control_pb2, local_pb2
from mlfabric.wire.errors import MlfabricError  # defined beside the codec, which raises it too
from mlfabric.wire.framing import (
    MAX_LOCAL_MESSAGE,
    MessageReader,
    ProtocolError,
    default_socket_path,
    send_message,
)

__all__ = [
    "APPLIED",
    "DROPPED",
    "UNKNOWN",
    "LocalClient",
    "MlfabricError",
    "PushHandle",
    "PushResult",
]


#: A push whose update the server applied.
APPLIED = "APPLIED"
#: A push whose update was not applied (``PushResult.reason`` says why).
DROPPED = "DROPPED"
#: A push whose update may or may not have been applied: the server process went away after
#: the update was handed to it and before its verdict (``PushResult.reason`` says what
#: happened; compare the model's version to find out). Never reported as DROPPED.
UNKNOWN = "UNKNOWN"

_OUTCOME_NAMES = {
    control_pb2.OUTCOME_APPLIED: APPLIED,
    control_pb2.OUTCOME_DROPPED: DROPPED,
    control_pb2.OUTCOME_UNKNOWN: UNKNOWN,
}


@dataclass(frozen=True)
class PushResult:
    """How a push ended.

    Attributes
    ----------
    status : str
        :data:`APPLIED`, :data:`DROPPED`, or :data:`UNKNOWN` (whether the server applied it
        cannot be known; ``reason`` says why).
    delay : int
        The update's delay at the server (version at apply time minus base version).
    version : int
        The server's model version after the update (applied) or when it was dropped.
    reason : str
        Why it was dropped, or why its outcome is unknown ("" when applied).
    update_id : str
        ``"<host>/<sequence>"``.
    """

    status: str
    delay: int
    version: int
    reason: str
    update_id: str

    @property
    def applied(self) -> bool:
        """True when the server applied the update."""
        return self.status == APPLIED


class PushHandle:
    """A push in flight; :meth:`wait` gives its :class:`PushResult`.

    Parameters
    ----------
    server : str
        The server pushed to.
    on_final : callable, optional
        ``on_final(lost)`` once the push resolved or failed; ``lost`` is True when the daemon
        connection broke (the daemon may then still read the update's memfd).
    """

    def __init__(self, server: str, on_final: Callable[[bool], None] | None = None) -> None:
        self.server = server
        self._on_final = on_final
        self.update_id = ""
        self._done = threading.Event()
        self._result: PushResult | None = None
        self._error: MlfabricError | None = None

    def done(self) -> bool:
        """True once the push is resolved (or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> PushResult:
        """Block until the push resolves.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; None waits for ever.

        Returns
        -------
        PushResult

        Raises
        ------
        TimeoutError
            The push did not resolve in time (it is still in flight).
        MlfabricError
            The daemon refused the push (bad tensor, unknown server) or the connection broke.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"push {self.update_id or '(not yet accepted)'} to {self.server!r} unresolved")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _on_event(self, event: Any, fd: int | None) -> bool:
        """Handle an event for this push; True when it is final.

        Only the first final event counts: a connection that breaks just after the verdict
        came (before the handler was forgotten) must not turn it into an error, nor call
        ``on_final`` a second time (it would free the update's memfd after it went back to
        the pool, and a later push would get a closed descriptor).
        """
        if fd is not None:
            os.close(fd)
        if self._done.is_set():
            return True
        kind = event.WhichOneof("kind")
        if kind == "push_accepted":
            self.update_id = event.push_accepted.update_id
            return False
        if kind == "push_result":
            r = event.push_result
            status = _OUTCOME_NAMES.get(r.outcome, DROPPED)
            self._result = PushResult(status, int(r.delay), int(r.version), r.reason, r.update_id)
        else:
            code, message = (
                (event.error.code, event.error.message) if kind == "error" else ("bad_reply", kind)
            )
            self._error = MlfabricError(message, code=code)
        self._done.set()
        if self._on_final is not None:
            self._on_final(self._error is not None and self._error.code == "disconnected")
        return True


EventHandler = Callable[[Any, int | None], None]


class LocalClient:
    """A training process's connection to its daemon (one role per connection).

    Parameters
    ----------
    path : str
        The daemon's Unix socket.

    Notes
    -----
    :meth:`connect` opens the socket and starts a reader thread. Replies are routed by
    ``request_id`` to the handler registered by :meth:`submit` (or to :meth:`call`'s
    waiter); unsolicited events (``request_id`` 0, e.g. ``DeliverUpdate``) go to the
    handler given to :meth:`set_unsolicited`. Handlers run on the reader thread and get
    ``(event, fd)`` where ``fd`` is the passed descriptor (the handler owns it) or None.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._handlers: dict[int, EventHandler] = {}
        self._unsolicited: EventHandler | None = None
        self._ids = itertools.count(1)
        self._reader: threading.Thread | None = None
        self._closed_reason: str | None = None

    def connect(self) -> None:
        """Connect to the daemon.

        Raises
        ------
        MlfabricError
            ``no_daemon`` when nothing listens at the socket; the message says how to start one.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise MlfabricError(
                f"no mlfabric daemon at {self.path} ({exc.strerror or exc}); start one with "
                f"`mlfabric daemon --host NAME --scheduler HOST:PORT --socket {self.path} "
                "--data-listen 127.0.0.1:0`, or point MLFABRIC_DAEMON at a running daemon's socket",
                code="no_daemon",
            ) from exc
        self._sock = sock
        self._reader = threading.Thread(target=self._read_loop, name="mlfabric-local-reader", daemon=True)
        self._reader.start()

    def set_unsolicited(self, handler: EventHandler) -> None:
        """Route events that answer no request (``DeliverUpdate``) to ``handler``."""
        self._unsolicited = handler

    def submit(self, request: Any, handler: EventHandler, fd: int | None = None) -> int:
        """Send ``request`` (a ``LocalRequest``); events answering it go to ``handler``.

        The handler stays registered until :meth:`forget` is called for the id.

        Returns
        -------
        int
            The request id.
        """
        request_id = next(self._ids)
        request.request_id = request_id
        with self._lock:
            if self._closed_reason is not None:
                raise MlfabricError(self._closed_reason, code="disconnected")
            self._handlers[request_id] = handler
        self.send(request, fd)
        return request_id

    def forget(self, request_id: int) -> None:
        """Stop routing events for ``request_id``."""
        with self._lock:
            self._handlers.pop(request_id, None)

    def send(self, request: Any, fd: int | None = None) -> None:
        """Send a request that expects no reply (a verdict, a published model)."""
        if self._sock is None:
            raise MlfabricError("not connected to a daemon", code="disconnected")
        try:
            with self._write_lock:
                send_message(self._sock, request, fd)
        except OSError as exc:
            raise MlfabricError(
                f"daemon at {self.path} connection failed: {exc}", code="disconnected"
            ) from exc

    def call(
        self, request: Any, fd: int | None = None, timeout: float | None = None
    ) -> tuple[Any, int | None]:
        """Send ``request`` and wait for the first event answering it.

        Returns
        -------
        event : LocalEvent
        fd : int or None
            A descriptor passed with the event (the caller owns it).

        Raises
        ------
        MlfabricError
            With the daemon's error code and message when it answers ``LocalError``.
        TimeoutError
            When no answer comes within ``timeout`` seconds.
        """
        done = threading.Event()
        box: list[tuple[Any, int | None]] = []

        def handler(event: Any, event_fd: int | None) -> None:
            box.append((event, event_fd))
            done.set()

        request_id = self.submit(request, handler, fd)
        try:
            if not done.wait(timeout):
                raise TimeoutError(f"no answer from the daemon at {self.path} within {timeout} s")
        finally:
            self.forget(request_id)
        event, event_fd = box[0]
        raise_for_error(event, event_fd)
        return event, event_fd

    def close(self) -> None:
        """Close the connection (the daemon drops this connection's role)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):  # already disconnected
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)

    def _read_loop(self) -> None:
        assert self._sock is not None
        reader = MessageReader(self._sock)
        reason = f"the daemon at {self.path} closed the connection"
        code = "disconnected"
        try:
            while True:
                body = reader.read()
                if body is None:
                    break
                event = local_pb2.LocalEvent.FromString(body)
                kind = event.WhichOneof("kind")
                payload_kinds = ("model", "deliver", "allreduce_result")
                carries = kind in payload_kinds and getattr(event, kind).has_payload
                carries = carries or (kind == "registered" and event.registered.model.has_payload)
                carries = carries or (kind == "resynced" and event.resynced.model.has_payload)
                fd = reader.take_fd() if carries else None
                if kind == "error" and event.error.code == "permission_denied" and not event.request_id:
                    reason = f"the daemon at {self.path} refused this process: {event.error.message}"
                    code = event.error.code
                self._dispatch(event, fd)
        except (OSError, ProtocolError, ValueError) as exc:
            reason = f"connection to the daemon at {self.path} failed: {exc}"
        finally:
            reader.close()
            self._fail_all(reason, code)

    def _dispatch(self, event: Any, fd: int | None) -> None:
        with self._lock:
            handler = self._handlers.get(event.request_id) if event.request_id else self._unsolicited
        if handler is None:
            if fd is not None:
                os.close(fd)
            return
        handler(event, fd)

    def _fail_all(self, reason: str, code: str = "disconnected") -> None:
        with self._lock:
            self._closed_reason = reason
            handlers = list(self._handlers.values())
            self._handlers.clear()
            unsolicited = self._unsolicited
        event = local_pb2.LocalEvent(error=local_pb2.LocalError(code=code, message=reason))
        for handler in handlers:
            handler(event, None)
        if unsolicited is not None:
            unsolicited(event, None)


def raise_for_error(event: Any, fd: int | None = None) -> None:
    """Raise :class:`MlfabricError` if ``event`` is a ``LocalError`` (closing ``fd``)."""
    if event.WhichOneof("kind") == "error":
        if fd is not None:
            os.close(fd)
        raise MlfabricError(event.error.message, code=event.error.code)


def check_size(request: Any, what: str) -> None:
    """Refuse a local request larger than the local message limit, naming the limit."""
    size = request.ByteSize()
    if size > MAX_LOCAL_MESSAGE:
        raise MlfabricError(
            f"{what} is {size} bytes, over the {MAX_LOCAL_MESSAGE}-byte limit of a local message "
            "(shorten the job, server or worker name)",
            code="bad_request",
        )


def connect(daemon: str | None) -> LocalClient:
    """A connected :class:`LocalClient` to the daemon at ``daemon`` (default: the default socket)."""
    client = LocalClient(default_socket_path(daemon))
    client.connect()
    return client
