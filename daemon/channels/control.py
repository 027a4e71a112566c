"""The daemon's control stream to the scheduler: one gRPC bidi ``Scheduler.Session`` (control.proto).

The daemon says ``Hello``; the scheduler answers ``Welcome``; then role registrations,
update-ready notifications and transfer reports go up, and role acks and directives (send,
drop, job updates) come down, all on the one stream (DESIGN §3, §7; MLfabric §4: the
scheduler sees only control messages, never tensor bytes).

A scheduler that refuses the ``Hello`` (INVALID_ARGUMENT, e.g. a host name not in its bandwidth
graph; PERMISSION_DENIED, a host name its certificate does not carry) is not retried. When the
stream breaks, :class:`ControlStream` tells the daemon (which resolves the pushes that were
waiting for a directive, so none is silently lost) and reconnects with exponential backoff; after
each ``Welcome`` the daemon re-registers its roles. Keepalive pings
(:mod:`mlfabric.wire.keepalive`, the setting the scheduler's server expects) keep idle streams
alive through proxies and detect a dead scheduler. A refused ``RegisterRole`` carries an
``ErrorCode``; :func:`local_error_code` turns it into the local API's code.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from mlfabric.proto.v1 import control_pb2, control_pb2_grpc
from mlfabric.wire.keepalive import CHANNEL_OPTIONS
from mlfabric.wire.tls import TlsFiles, grpc_channel

__all__ = ["ControlStream", "control_channel", "local_error_code"]

_LOG = logging.getLogger("mlfabric.daemon.control")


def local_error_code(code: int) -> str:
    """The local API's error code (``LocalError.code``) for a scheduler's refusal ``code``.

    ``ERROR_CODE_<NAME>`` becomes ``"<name>"``; a code this daemon does not know (a newer
    scheduler) or none at all becomes ``"refused"``.

    Examples
    --------
    >>> local_error_code(control_pb2.ERROR_CODE_UNKNOWN_JOB)
    'unknown_job'
    >>> local_error_code(control_pb2.ERROR_CODE_DUPLICATE_SERVER)
    'duplicate_server'
    >>> local_error_code(control_pb2.ERROR_CODE_UNSPECIFIED), local_error_code(999)
    ('refused', 'refused')
    """
    if code == control_pb2.ERROR_CODE_UNSPECIFIED or code not in control_pb2.ErrorCode.values():
        return "refused"
    return control_pb2.ErrorCode.Name(code).removeprefix("ERROR_CODE_").lower()


def control_channel(tls: TlsFiles | None, server_name: str | None = None) -> Callable[[str], grpc.Channel]:
    """``channel_factory`` of the control stream: mTLS with ``tls`` (this host's certificate), else
    plaintext; keepalive either way. ``server_name``: the name the scheduler's certificate carries."""
    return lambda target: grpc_channel(target, tls, server_name, CHANNEL_OPTIONS)


_CLOSE = object()


class ControlStream:
    """A self-healing ``Session`` stream to the scheduler, run on its own thread.

    Parameters
    ----------
    target : str
        The scheduler's ``"host:port"``.
    hello : callable
        ``hello() -> Hello``, the first message of every session.
    on_directive : callable
        ``on_directive(Directive)`` for everything after ``Welcome`` (called on the stream thread).
    on_connected : callable
        ``on_connected(Welcome)`` once a session is welcomed (re-register roles here; sends work).
    on_disconnected : callable
        ``on_disconnected(reason)`` when a welcomed session ends.
    backoff_initial, backoff_max : float
        Seconds between reconnection attempts: doubling from the first to the second.
    channel_factory : callable, optional
        ``channel_factory(target) -> grpc.Channel`` (default: an insecure channel with keepalive).

    Examples
    --------
    >>> stream = ControlStream("127.0.0.1:1", lambda: control_pb2.Hello(host="h"),
    ...                        print, print, print)
    >>> stream.connected.is_set()
    False
    """

    def __init__(
        self,
        target: str,
        hello: Callable[[], Any],
        on_directive: Callable[[Any], None],
        on_connected: Callable[[Any], None],
        on_disconnected: Callable[[str], None],
        *,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        channel_factory: Callable[[str], grpc.Channel] | None = None,
    ) -> None:
        self.target = target
        self._hello = hello
        self._on_directive = on_directive
        self._on_connected = on_connected
        self._on_disconnected = on_disconnected
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._channel_factory = channel_factory or (
            lambda t: grpc.insecure_channel(t, options=CHANNEL_OPTIONS)
        )
        self._lock = threading.Lock()
        self._outbox: queue.Queue[Any] | None = None
        self._call: Any = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        #: Set while a welcomed session is up.
        self.connected = threading.Event()
        #: Set when the scheduler refused the Hello (INVALID_ARGUMENT): no more attempts.
        self.refused = threading.Event()
        #: Why the last session ended (or the last attempt failed).
        self.last_error = ""
        #: Number of sessions welcomed so far.
        self.sessions = 0

    def start(self) -> None:
        """Start connecting (in the background)."""
        self._thread = threading.Thread(target=self._run, name="control-stream", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the stream and stop reconnecting."""
        self._stopping.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout)

    def send(self, message: Any) -> bool:
        """Queue a ``DaemonMessage``; False (nothing queued) when no welcomed session is up."""
        with self._lock:
            outbox = self._outbox if self.connected.is_set() else None
        if outbox is None:
            return False
        outbox.put(message)
        return True

    def _requests(self, outbox: queue.Queue[Any]) -> Iterator[Any]:
        yield control_pb2.DaemonMessage(hello=self._hello())
        while True:
            message = outbox.get()
            if message is _CLOSE:
                return
            yield message

    def _run(self) -> None:
        backoff = self._backoff_initial
        while not self._stopping.is_set():
            welcomed = self._session()
            if self._stopping.is_set() or self.refused.is_set():
                return
            if welcomed:
                backoff = self._backoff_initial
            _LOG.warning("scheduler %s: %s; reconnecting in %.1f s", self.target, self.last_error, backoff)
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, self._backoff_max)

    def _session(self) -> bool:
        """One session, from connect to break; True if it was welcomed."""
        outbox: queue.Queue[Any] = queue.Queue()
        channel = self._channel_factory(self.target)
        welcomed = False
        try:
            stub = control_pb2_grpc.SchedulerStub(channel)
            call = stub.Session(self._requests(outbox))
            with self._lock:
                self._outbox, self._call = outbox, call
            if self._stopping.is_set():
                call.cancel()
            for directive in call:
                if directive.WhichOneof("kind") == "welcome" and not welcomed:
                    welcomed = True
                    self.sessions += 1
                    self.connected.set()
                    _LOG.info("scheduler %s: welcomed (policy %s)", self.target, directive.welcome.policy)
                    self._on_connected(directive.welcome)
                elif welcomed:
                    self._on_directive(directive)
            self.last_error = "the scheduler closed the stream"
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            self.last_error = f"stream failed ({getattr(code, 'name', code)}: {details})"
            refusals = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
            if code in refusals and not welcomed:
                _LOG.error("scheduler %s refused this daemon: %s", self.target, details)
                self.refused.set()
        finally:
            with self._lock:
                self._outbox, self._call = None, None
            self.connected.clear()
            outbox.put(_CLOSE)
            channel.close()
        if welcomed:
            self._on_disconnected(self.last_error)
        return welcomed
