"""The gRPC face of the scheduler service: ``Scheduler.Session`` streams and the server.

:class:`SchedulerServicer` only unpacks daemon messages into the
:class:`~mlfabric.scheduler.service.core.SchedulerCore` and streams its directives back,
mapping the core's domain errors on ``Hello`` to gRPC status codes; :func:`start_server`
serves it with the health service. The message sequence is in
:mod:`mlfabric.scheduler.service.core`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.proto.v1 import control_pb2_grpc as pb_grpc
from mlfabric.scheduler.service.records import HostAlreadyConnected, SchedulerError
from mlfabric.wire.keepalive import MIN_PING_INTERVAL_MS
from mlfabric.wire.tls import auth_context_names

if TYPE_CHECKING:  # the core imports this module (and re-exports its names)
    from mlfabric.scheduler.service.core import DaemonSession, SchedulerCore

__all__ = ["SERVER_OPTIONS", "SchedulerServicer", "start_server"]

#: gRPC server options: keepalive pings to idle daemons, and tolerance of theirs (daemons
#: may ping every 5 s or slower without being sent GOAWAY)
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
    # a second scheduler on the same port must fail, not share the port
    ("grpc.so_reuseport", 0),
]


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """``Scheduler.Session``: unpack daemon messages into the core, stream its directives back."""

    def __init__(self, core: SchedulerCore, *, check_host: bool = False) -> None:
        self.core = core
        #: mTLS: a daemon's Hello must name a host its client certificate carries
        self.check_host = check_host

    async def Session(
        self, request_iterator: AsyncIterator[pb.DaemonMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Directive]:
        """One daemon's stream; see the module docstring for the message sequence."""
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed DaemonMessage: {exc}")
        if first.WhichOneof("kind") != "hello":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the first message of a session must be Hello, got {first.WhichOneof('kind')}",
            )
        if self.check_host:
            names = auth_context_names(context.auth_context())
            if first.hello.host not in names:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"a daemon may speak only for its own host: Hello names host {first.hello.host!r} "
                    f"but its certificate names {', '.join(sorted(names)) or 'no host'}",
                )
        try:
            session = self.core.hello(first.hello)
        except HostAlreadyConnected as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except SchedulerError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reader = asyncio.create_task(self._read(requests, session))
        try:
            yield self.core.welcome()
            while (directive := await session.queue.get()) is not None:
                yield directive
        finally:
            reader.cancel()
            self.core.goodbye(session)
        if not reader.cancelled() and reader.done() and (error := reader.exception()) is not None:
            if isinstance(error, DecodeError):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed DaemonMessage: {error}")
            raise error

    async def _read(self, requests: AsyncIterator[pb.DaemonMessage], session: DaemonSession) -> None:
        try:
            async for m in requests:
                self.core.on_message(session, m)
        finally:
            session.close()


async def start_server(
    core: SchedulerCore,
    listen: str,
    *,
    options: Sequence[tuple[str, Any]] = SERVER_OPTIONS,
    extra: Sequence[tuple[str, Callable[[grpc.aio.Server], None]]] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with the scheduler and health services on ``listen``.

    Parameters
    ----------
    core : SchedulerCore
    listen : str
        ``host:port``; port 0 picks a free port.
    options : sequence
        gRPC server options (keepalive, see :data:`SERVER_OPTIONS`).
    extra : sequence of (str, callable)
        More services: ``(full service name, add_to_server(server))`` (the admin service).
    credentials : grpc.ServerCredentials, optional
        Serve mTLS (:func:`mlfabric.wire.tls.server_credentials`, client certificates required)
        and check that each daemon's ``Hello`` names a host its certificate carries, else
        abort PERMISSION_DENIED naming both (None: plaintext, no check).

    Returns
    -------
    (grpc.aio.Server, int)
        The started server and the port it is bound to. Its health service reports
        ``SERVING`` for ``""`` and ``mlfabric.v1.Scheduler``.

    Raises
    ------
    RuntimeError
        If ``listen`` cannot be bound.
    """
    server = grpc.aio.server(options=list(options))
    servicer = SchedulerServicer(core, check_host=credentials is not None)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for _, add in extra:
        add(server)
    if credentials is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    await server.start()
    for service in ("", "mlfabric.v1.Scheduler", *(name for name, _ in extra)):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port
