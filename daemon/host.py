"""The host daemon: builds the channels and the roles, starts and stops them, routes messages (DESIGN §12).

A :class:`Daemon` is a router: it holds no role logic. Its channels
(:mod:`mlfabric.daemon.channels`) bring messages in — the local API's requests, the data
plane's frames, the control stream's directives — and each goes, by its routing key
(:mod:`~mlfabric.daemon.channels.routing`), to the one role that registered that key
(:meth:`~mlfabric.daemon.roles.base.Role.routes`): the registrar, the worker, server, replica,
aggregator and all-reduce roles (:mod:`mlfabric.daemon.roles`). The host also tells every
role about the daemon's life (start, stop, ticks, a local process going away, the scheduler
session coming and going), sends the transfer reports (to the scheduler, the report log and
its counters) and answers :meth:`Daemon.stats`.

The life of a push (MLfabric §4; DESIGN §3, §12): the worker role takes it in, the scheduler
decides, the worker role sends it through the peers channel, the server role on the server's
host hands it to the server process and answers with its verdict, which resolves the push.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from mlfabric.daemon.channels.budget import ByteBudget
from mlfabric.daemon.channels.control import ControlStream, control_channel
from mlfabric.daemon.channels.frames import Frame, FrameLimits, PayloadWatch, error_header
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.localapi import LocalApiServer, LocalConnection
from mlfabric.daemon.channels.payloadio import payload_length
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.daemon.channels.routing import FrameRoute, directive_kind, frame_route, request_kind
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.reports import TransferReportLog
from mlfabric.daemon.roles.aggregator.role import AggregatorRole
from mlfabric.daemon.roles.allreduce.role import AllreduceRole
from mlfabric.daemon.roles.base import (
    DirectiveHandler,
    FrameHandler,
    RequestHandler,
    Role,
    RoleContext,
    WatchHandler,
)
from mlfabric.daemon.roles.directory import Directory
from mlfabric.daemon.roles.registrar import Registrar
from mlfabric.daemon.roles.relay.role import ModelRelays
from mlfabric.daemon.roles.replica.log import ReplicationLogs
from mlfabric.daemon.roles.replica.role import ReplicaRole
from mlfabric.daemon.roles.server.serving import ServerRoles
from mlfabric.daemon.roles.worker.intake import WorkerRole
from mlfabric.daemon.stats import Counters, DaemonStats, LoadGauge
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.wire.memfd import MemfdPool
from mlfabric.wire.version import __version__

__all__ = ["SHUTDOWN_DRAIN", "Daemon", "Ticker"]

_LOG = logging.getLogger("mlfabric.daemon")
_MODEL = dataplane_pb2.FRAME_KIND_MODEL

#: seconds a stopping daemon waits for its transfers under way to bring their verdicts
SHUTDOWN_DRAIN = 2.0


_Key = TypeVar("_Key")
_Handler = TypeVar("_Handler")


def _claim(table: dict[_Key, _Handler], owned: Mapping[_Key, _Handler], role: Role) -> None:
    """Route the kinds ``role`` owns (``owned``) to their handlers in ``table``.

    Raises
    ------
    ValueError
        Another role owns one of the kinds already.
    """
    taken = set(table) & set(owned)
    if taken:
        raise ValueError(f"{type(role).__name__} claims kinds another role owns: {sorted(map(str, taken))}")
    table.update(owned)


class Ticker:
    """Calls each function every ``interval`` seconds on one thread, between :meth:`start` and :meth:`stop`.

    A function that raises is logged with its traceback and called again at the next tick.

    Examples
    --------
    >>> calls = []
    >>> t = Ticker(0.01, [lambda: calls.append(1)])
    >>> t.start(); import time; time.sleep(0.1); t.stop()
    >>> len(calls) > 0
    True
    """

    def __init__(self, interval: float, functions: Sequence[Callable[[], object]]) -> None:
        self.interval = interval
        self._functions = list(functions)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._run, name="daemon-ticker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (after the tick running now)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            for fn in self._functions:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - housekeeping must go on; the error is logged
                    _LOG.exception("daemon housekeeping %r failed", fn)


class Daemon:
    """One host's daemon. Construct, :meth:`start`, and :meth:`stop` (no I/O before ``start``).

    Parameters
    ----------
    config : DaemonConfig
        Addresses and limits.
    clock : callable
        Monotonic seconds (``ready_at`` of updates, timeouts).
    channel_factory : callable, optional
        ``channel_factory(target) -> grpc.Channel`` for the control stream (tests).
    report_log : TransferReportLog, optional
        Also append every transfer report sent to the scheduler here (opened by
        :meth:`start`, closed by :meth:`stop`).
    host_load : callable
        ``host_load() -> float``: the host's CPU load per core, stamped on every update
        announced (``UpdateReady.cpu_load``; default: :func:`~mlfabric.daemon.stats.cpu_load_per_core`
        read at most once a second, :class:`~mlfabric.daemon.stats.LoadGauge`).

    Attributes
    ----------
    registrar, worker, serving, replica, models, aggregator, allreduce
        The roles (:mod:`mlfabric.daemon.roles`), in the order they are told of the daemon's life.

    Examples
    --------
    >>> daemon = Daemon(DaemonConfig(host="w0", scheduler="127.0.0.1:7077", socket_path="/tmp/w0.sock"))
    >>> sorted(daemon.routes()["directives"])[:4]
    ['aggregate', 'allreduce', 'allreduce_abort', 'codec_advice']
    >>> daemon.start()          # doctest: +SKIP
    >>> daemon.data_address     # doctest: +SKIP
    '127.0.0.1:40123'
    >>> daemon.stop()           # doctest: +SKIP
    """

    def __init__(
        self,
        config: DaemonConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        channel_factory: Callable[[str], Any] | None = None,
        report_log: TransferReportLog | None = None,
        host_load: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self._host_load = host_load or LoadGauge()
        self.host = config.host
        self._report_log = report_log
        self._counters = Counters()
        # ---------------------------------------------------------------- channels
        egress, ingress = TokenBucket(config.egress_rate), TokenBucket(config.ingress_rate)
        limits = FrameLimits(max_payload_bytes=config.max_payload_bytes)
        self.receive_budget = ByteBudget(config.max_inflight_bytes, "receive")
        self.push_budget = ByteBudget(config.max_inflight_bytes, "push")
        self.receive_buffers = MemfdPool(
            min(config.receive_pool_bytes, config.max_inflight_bytes),
            name="mlfabric-dataplane",
            budget=self.receive_budget,
            budget_timeout=config.io_timeout,
            max_idle_seconds=config.pool_idle_seconds,
        )
        self._listener = DataPlaneListener(
            config.data_listen,
            self._on_frame,
            limits,
            ingress,
            egress,
            alloc=self.receive_buffers.allocate,
            io_timeout=config.io_timeout,
            idle_timeout=config.idle_timeout,
            header_timeout=config.header_timeout,
            max_connections=config.max_connections,
            auth=config.data_auth,
            watch=self._watch_frame,
        )
        self._peers = PeerPool(
            limits,
            egress,
            ingress,
            connect_timeout=config.connect_timeout,
            io_timeout=config.io_timeout,
            max_idle_seconds=None if config.idle_timeout is None else config.idle_timeout / 2,
            auth=config.data_auth,
            send_attempts=config.send_attempts,
            retry_backoff=config.retry_backoff,
        )
        self._local = LocalApiServer(
            config.socket_path,
            self._on_request,
            self._on_close,
            idle_timeout=config.idle_timeout,
            message_timeout=config.header_timeout,
            max_connections=config.max_connections,
            access=config.local_access,
        )
        self._control = ControlStream(
            config.scheduler,
            lambda: control_pb2.Hello(
                host=self.host,
                data_address=self.data_address,
                version=__version__,
                can_aggregate=config.aggregator,
            ),
            self._on_directive,
            self._on_connected,
            self._on_disconnected,
            channel_factory=channel_factory or control_channel(config.tls, config.tls_server_name),
        )
        self._tasks = ThreadPoolExecutor(max_workers=32, thread_name_prefix="daemon-task")
        self._context = RoleContext(
            config.host,
            config.scheduler,
            self._send,
            self._tasks.submit,
            threading.Event(),
            clock,
        )
        # ---------------------------------------------------------------- roles
        ctx, send = self._context, self._send
        self.directory = Directory()
        self.registrar = Registrar(ctx, self.directory)
        #: replication logs of this host's servers that have a replica (docs/replication.md)
        replication = ReplicationLogs(config.host, self._peers.request, send)
        self.serving = ServerRoles(
            ctx,
            self.registrar,
            self.directory,
            limits,
            config.verdict_timeout,
            replication=replication,
            alloc=self.receive_buffers.allocate,
            round_timeout=config.round_timeout,
        )
        self.replica = ReplicaRole(
            ctx, self.registrar, self.directory, self.serving, replication, self._peers
        )
        #: gets: the model cache, relays, a version floor (docs/model-relays.md)
        self.models = ModelRelays(
            ctx,
            self.directory,
            self._peers.request,
            self.serving,
            budget=self.receive_budget,
            max_wait=None if config.io_timeout is None else 0.8 * config.io_timeout,
            max_model_bytes=config.max_payload_bytes,
        )
        self.worker = WorkerRole(
            ctx,
            self.registrar,
            self.directory,
            self._peers,
            self.models,
            self.push_budget,
            self._send_report,
            limits=limits,
            fallback_after=config.fallback_after,
            push_timeout=config.push_timeout,
            budget_timeout=config.io_timeout,
            on_push=self._counters.push,
        )
        self.aggregator = AggregatorRole(
            ctx,
            self.receive_buffers.allocate,
            lambda ready: send(control_pb2.DaemonMessage(update_ready=ready)),
            lambda failed: send(control_pb2.DaemonMessage(aggregate_failed=failed)),
            self._send_report,
            self._peers.deliver,
            enabled=config.aggregator,
        )
        #: all-reduces of this host's processes (docs/allreduce.md)
        self.allreduce = AllreduceRole(ctx, self._peers.request)
        self._roles: list[Role] = [
            self.registrar,
            self.aggregator,
            self.allreduce,
            self.serving,
            self.replica,
            self.models,
            self.worker,
        ]
        self._requests: dict[str, RequestHandler] = {}
        self._frames: dict[FrameRoute, FrameHandler] = {}
        self._directives: dict[str, DirectiveHandler] = {}
        self._watches: dict[FrameRoute, WatchHandler] = {}
        for role in self._roles:
            routes = role.routes()
            _claim(self._requests, routes.requests, role)
            _claim(self._frames, routes.frames, role)
            _claim(self._directives, routes.directives, role)
            _claim(self._watches, routes.watches, role)
        self._ticker = Ticker(0.1, [self.receive_buffers.trim, *(role.tick for role in self._roles)])

    @property
    def data_address(self) -> str:
        """The data-plane listener's ``"ip:port"`` (empty before :meth:`start`)."""
        return self._context.data_address

    def routes(self) -> dict[str, list[Any]]:
        """The kinds routed, by table (``requests``, ``frames``, ``directives``)."""
        return {
            "requests": list(self._requests),
            "frames": list(self._frames),
            "directives": list(self._directives),
        }

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        """Listen on the data plane and the local socket, connect to the scheduler.

        Raises
        ------
        TimeoutError
            The scheduler did not welcome the daemon within ``timeout`` seconds (everything
            started is stopped again).
        """
        if self._report_log is not None:
            self._report_log.start()
        self._context.data_address = self._listener.start()
        for role in self._roles:
            role.start()
        self._local.start()
        self._control.start()
        self._ticker.start()
        deadline = time.monotonic() + timeout
        while not self._control.connected.wait(0.05):
            if self._control.refused.is_set() or time.monotonic() > deadline:
                break
        if not self._control.connected.is_set():
            error = self._control.last_error or "no answer"
            self.stop()
            raise TimeoutError(
                f"scheduler at {self.config.scheduler} did not welcome host {self.host!r}: {error}"
            )

    def stop(self) -> None:
        """Stop everything; every push held resolves before its process is disconnected.

        No new process is accepted; the transfers under way get up to :data:`SHUTDOWN_DRAIN`
        seconds to bring their verdicts, the rest are cut (UNKNOWN where the frame may have
        arrived); pushes never sent resolve DROPPED (UNKNOWN if an aggregator summed them).
        Only then are the training processes' connections closed (issue 27: a worker got
        "disconnected" for a push that was then applied).
        """
        self._context.stopping.set()
        self._control.stop()
        self._ticker.stop()
        self._local.stop_accepting()
        self.worker.drain(SHUTDOWN_DRAIN)
        self._listener.stop()
        self._peers.stop(f"daemon of host {self.host!r} is stopping")  # cut the transfers in flight
        self._tasks.shutdown(wait=True, cancel_futures=True)
        for role in self._roles:
            role.stop()
        self._local.stop()
        self._peers.close()
        self.receive_buffers.close()
        if self._report_log is not None:
            self._report_log.stop()

    def stats(self) -> DaemonStats:
        """What this daemon counted, and its gauges now (read by the metrics collector)."""
        return self._counters.snapshot(
            self.host,
            local_clients=self.worker.workers + self.serving.processes,
            fallback_active=self.worker.fallback.active,
            unannounced_pushes=self.worker.fallback.unannounced(),
            inflight_bytes={"push": self.push_budget.in_use, "receive": self.receive_budget.in_use},
            pool_idle_bytes=self.receive_buffers.idle_bytes,
            models=self.models.stats(),
        )

    def _send(self, message: Any) -> bool:
        """Queue ``message`` on the control stream, an announced update stamped with the host's load."""
        if message.HasField("update_ready"):
            message.update_ready.cpu_load = self._host_load()
        return self._control.send(message)

    def _send_report(self, report: Any) -> None:
        """Send a ``TransferReport`` to the scheduler, count it, append it to the report log if any."""
        self._control.send(control_pb2.DaemonMessage(transfer_report=report))
        self._counters.report(report)
        if self._report_log is not None:
            try:
                self._report_log.write(report)
            except (OSError, RuntimeError) as exc:  # full disk, or a report racing stop()
                _LOG.error(
                    "transfer report %s not written to %s: %s", report.update_id, self._report_log.path, exc
                )

    # ------------------------------------------------------------------ routers

    def _on_frame(self, frame: Frame) -> Response:
        """A data-plane frame: to the role that owns its route (the listener sends the reply)."""
        route = frame_route(frame.header)
        self._counters.frame(frame.header, route)
        handler = self._frames.get(route)
        if handler is not None:
            response = handler(frame)
            if response.header.kind == _MODEL:  # a model (or a piece) served to a peer
                self._counters.model(response.header, payload_length(response.payload))
            return response
        frame.release()
        reason = f"unexpected frame kind {frame.header.kind}"
        return Response(error_header(reason, update_id=frame.header.update_id, src_host=self.host))

    def _watch_frame(self, header: Any, payload: memoryview) -> PayloadWatch | None:
        """A frame whose payload is landing: a watch from the role that owns its route, if it keeps one."""
        watch = self._watches.get(frame_route(header))
        return watch(header, payload) if watch is not None else None

    def _on_request(self, conn: LocalConnection, request: Any, fd: int | None) -> None:
        """A local request: to the role that owns its kind; close the fd unless the role kept it."""
        kind = request_kind(request)
        handler = self._requests.get(kind)
        if handler is None:
            conn.error(
                request.request_id, "bad_request", f"empty or unknown local request kind {kind or None!r}"
            )
        else:
            fd = handler(conn, request, fd)
        if fd is not None:  # a handler that keeps the fd returns None
            os.close(fd)

    def _on_directive(self, directive: Any) -> None:
        """A directive from the scheduler: to the role that owns its kind."""
        kind = directive_kind(directive)
        handler = self._directives.get(kind)
        if handler is None:
            _LOG.info("directive of kind %r: no role takes it", kind)
            return
        handler(getattr(directive, directive.WhichOneof("kind")))

    def _on_close(self, conn: LocalConnection) -> None:
        for role in self._roles:
            role.connection_closed(conn)

    def _on_connected(self, welcome: Any) -> None:
        """A (re)welcomed session: every role is told, then registers its processes again."""
        for role in self._roles:
            role.scheduler_connected()
        for role in self._roles:
            role.register_again()

    def _on_disconnected(self, reason: str) -> None:
        if self._context.stopping.is_set():
            return  # our own stop ended the session: the roles' stop resolves what they hold
        for role in self._roles:
            role.scheduler_lost(reason)
