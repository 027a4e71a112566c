"""What every role of a daemon shares: the :class:`Role` base class, its context, the verdict.

A role (worker, server, replica, aggregator, all-reduce; and the registrar, the scheduler
session's side of registrations) owns the messages of its kinds: :meth:`Role.routes` names the
local requests, data-plane frames (:class:`~mlfabric.daemon.channels.routing.FrameRoute`) and
directives it takes, with their handlers, and the host (:class:`mlfabric.daemon.host.Daemon`)
routes each message to the one role that owns its key. The rest of the class is the
daemon's life: :meth:`Role.start` and :meth:`Role.stop`, :meth:`Role.tick` (every 0.1 s), a
local process going away (:meth:`Role.connection_closed`) and the scheduler session coming and
going (:meth:`Role.scheduler_connected`, :meth:`Role.register_again`,
:meth:`Role.scheduler_lost`). Every role subclasses :class:`Role` and must define
:meth:`Role.routes`; the other methods are hooks that do nothing unless the role overrides them,
so a role's class shows which of the daemon's events it takes part in.

:class:`RoleContext` is what a role may use of its host besides the parts passed to it: its
names, the control stream, the task pool, the stopping flag and the clock (DESIGN §12).
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from mlfabric.daemon.channels.control import local_error_code
from mlfabric.daemon.channels.frames import Frame, PayloadWatch
from mlfabric.daemon.channels.listener import Response
from mlfabric.daemon.channels.localapi import LocalConnection
from mlfabric.daemon.channels.routing import FrameRoute
from mlfabric.proto.v1 import control_pb2, local_pb2

__all__ = [
    "DirectiveHandler",
    "FrameHandler",
    "RequestHandler",
    "Role",
    "RoleContext",
    "Routes",
    "Verdict",
    "WatchHandler",
    "already_registered",
    "model_reply",
    "refused",
]

#: ``handler(conn, request, fd) -> fd or None``: a local request; returns the fd to close
#: (None: the handler keeps the memfd passed with the request, or there was none)
RequestHandler: TypeAlias = Callable[[LocalConnection, Any, "int | None"], "int | None"]
#: ``handler(frame) -> Response``: a data-plane frame; the frame's buffer is the handler's
FrameHandler: TypeAlias = Callable[[Frame], Response]
#: ``handler(directive)``: the directive's message (e.g. the ``SendDirective``), on the stream
#: thread; what the handler returns is ignored
DirectiveHandler: TypeAlias = Callable[[Any], object]
#: ``watch(header, payload) -> PayloadWatch | None``: a frame whose payload is still landing
#: (the listener's thread; the frame goes to the route's :data:`FrameHandler` once whole)
WatchHandler: TypeAlias = Callable[[Any, memoryview], "PayloadWatch | None"]


@dataclass(frozen=True)
class Verdict:
    """The server's answer on one update (``UpdateVerdict`` / an ACK frame).

    ``handed_over`` is False for a DROPPED verdict on an update that never reached the
    server process (it was gone): certainly not applied, so it may go to a promoted replica.
    """

    outcome: control_pb2.Outcome
    delay: int
    version: int
    reason: str
    handed_over: bool = True

    @classmethod
    def dropped(cls, reason: str, version: int = 0) -> Verdict:
        """A DROPPED verdict with ``reason``."""
        return cls(control_pb2.OUTCOME_DROPPED, 0, version, reason)

    @classmethod
    def unknown(cls, reason: str, version: int = 0) -> Verdict:
        """An UNKNOWN verdict: whether the update was applied cannot be known; ``reason`` says why."""
        return cls(control_pb2.OUTCOME_UNKNOWN, 0, version, reason)


def _run_now(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass
class RoleContext:
    """What a role may use of its daemon besides the parts passed to it.

    Parameters
    ----------
    host : str
        This daemon's host name.
    scheduler : str
        The scheduler's address (named in messages).
    send : callable
        ``send(DaemonMessage) -> bool`` on the control stream; False when no session is up
        (default: never up).
    submit : callable
        ``submit(fn, *args)`` runs ``fn`` on the daemon's task pool (default: at once, here).
    stopping : threading.Event
        Set when the daemon stops.
    clock : callable
        Monotonic seconds.
    data_address : str
        This daemon's data-plane address, once its listener is up.

    Examples
    --------
    >>> ctx = RoleContext("w0", "127.0.0.1:7077")
    >>> ctx.send(control_pb2.DaemonMessage()), ctx.not_connected()
    (False, 'scheduler at 127.0.0.1:7077 is not connected')
    """

    host: str
    scheduler: str = ""
    send: Callable[[Any], bool] = lambda _message: False
    submit: Callable[..., Any] = _run_now
    stopping: threading.Event = field(default_factory=threading.Event)
    clock: Callable[[], float] = time.monotonic
    data_address: str = ""

    def not_connected(self) -> str:
        """The error of a request that needs the scheduler while it is away."""
        return f"scheduler at {self.scheduler} is not connected"


@dataclass(frozen=True)
class Routes:
    """The kinds a role owns, with their handlers (:class:`Role`)."""

    #: ``LocalRequest.kind`` -> handler
    requests: Mapping[str, RequestHandler] = field(default_factory=dict)
    #: frame route -> handler
    frames: Mapping[FrameRoute, FrameHandler] = field(default_factory=dict)
    #: directive kind (:func:`~mlfabric.daemon.channels.routing.directive_kind`) -> handler
    directives: Mapping[str, DirectiveHandler] = field(default_factory=dict)
    #: frame route -> a watch on its payloads while they land (pipelined aggregates)
    watches: Mapping[FrameRoute, WatchHandler] = field(default_factory=dict)


class Role(abc.ABC):
    """A part of the daemon that owns some kinds of messages (see the module's docstring).

    A subclass defines :meth:`routes` and overrides the hooks it needs; the others do nothing.

    Examples
    --------
    >>> class Echo(Role):
    ...     def routes(self) -> Routes:
    ...         return Routes(directives={"echo": print})
    >>> role = Echo()
    >>> role.start(); role.tick(); role.scheduler_lost("gone")   # hooks it does not override
    >>> sorted(role.routes().directives)
    ['echo']
    """

    @abc.abstractmethod
    def routes(self) -> Routes:
        """The local requests, frames and directives this role takes."""

    def start(self) -> None:
        """The daemon starts (its data-plane address is known, nothing is connected yet)."""
        return None

    def stop(self) -> None:
        """The daemon stops: resolve or fail whatever this role still holds."""
        return None

    def tick(self) -> None:
        """Periodic work (every 0.1 s, on the daemon's ticker thread)."""
        return None

    def connection_closed(self, conn: LocalConnection) -> None:
        """The local process of ``conn`` went away."""
        return None

    def scheduler_connected(self) -> None:
        """A scheduler session was welcomed (called on every role before any registers again)."""
        return None

    def register_again(self) -> None:
        """Register this role's processes with the new session (it knows none of them)."""
        return None

    def scheduler_lost(self, reason: str) -> None:
        """The scheduler session ended (the scheduler forgets what it knew of this daemon)."""
        return None


def already_registered(conn: LocalConnection, request_id: int) -> bool:
    """Answer ``bad_request`` when ``conn`` already has a role (one role per connection).

    Examples
    --------
    >>> class Conn:
    ...     role, name = "worker", "w0"
    ...     def error(self, rid, code, message): print(code, message)
    >>> already_registered(Conn(), 7)
    bad_request this connection is already registered as worker 'w0'
    True
    """
    if not conn.role:
        return False
    conn.error(
        request_id, "bad_request", f"this connection is already registered as {conn.role} {conn.name!r}"
    )
    return True


def refused(conn: LocalConnection, request_id: int, ack: Any, context: RoleContext) -> bool:
    """Answer a registration the scheduler refused, or could not be asked about (``ack`` None).

    The local error code is the scheduler's (``unknown_job``, ...), or ``unavailable`` when no
    session was up. Returns whether the registration was refused.
    """
    if ack is not None and ack.ok:
        return False
    error = ack.error if ack is not None else context.not_connected()
    conn.error(request_id, "unavailable" if ack is None else local_error_code(ack.code), error)
    return True


def model_reply(header: Any) -> Any:
    """The ``ModelReply`` for a process of a model that came in a MODEL frame (``header``).

    Examples
    --------
    >>> from mlfabric.proto.v1 import dataplane_pb2
    >>> model_reply(dataplane_pb2.FrameHeader(version=4, payload_bytes=8)).version
    4
    """
    return local_pb2.ModelReply(
        version=header.version, tensors=header.tensors, payload_bytes=header.payload_bytes, has_payload=True
    )
