"""Fixtures for the daemon tests: an in-test scheduler servicer and in-process daemons.

:class:`FakeScheduler` is a minimal ``Scheduler.Session`` servicer on a real gRPC server
(127.0.0.1, port 0): it welcomes daemons, acks roles (a worker of a job with no server is
refused "unknown job"), announces servers with ``JobUpdate`` and, unless ``hold`` is set,
answers every ``UpdateReady`` at once with a direct ``SendDirective`` to the server's host.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon
from mlfabric.proto.v1 import control_pb2, control_pb2_grpc


class FakeScheduler(control_pb2_grpc.SchedulerServicer):
    """A FIFO, direct-send scheduler that records what the daemons tell it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[str, tuple[queue.Queue[Any], str]] = {}
        self.servers: dict[str, dict[str, Any]] = {}
        self.params: dict[str, Any] = {}
        self.ready: list[Any] = []
        self.reports: list[Any] = []
        self.unregistered: list[Any] = []
        #: (host, job, name) of every role registration, in arrival order
        self.registered: list[tuple[str, str, str]] = []
        #: worker registrations that were acknowledged ok (host, job, name)
        self.accepted: list[tuple[str, str, str]] = []
        self.hold = False
        self.server: grpc.Server | None = None
        self.address = ""

    def start(self, port: int = 0) -> str:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        control_pb2_grpc.add_SchedulerServicer_to_server(self, self.server)
        bound = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.address = f"127.0.0.1:{bound}"
        return self.address

    def stop(self) -> None:
        with self.lock:
            for out, _ in self.sessions.values():
                out.put(None)
            self.sessions.clear()
        if self.server is not None:
            self.server.stop(0).wait(5)

    def send(self, host: str, directive: Any) -> None:
        with self.lock:
            out, _ = self.sessions[host]
        out.put(directive)

    def send_to_server(self, ready: Any) -> None:
        """Release ``ready`` directly to its server's host."""
        with self.lock:
            info = self.servers[ready.job][ready.server]
            src = next(h for h, (_, _) in self.sessions.items() if ready.update_id.startswith(h + "/"))
        send = control_pb2.SendDirective(
            update_id=ready.update_id,
            next_hop_host=info.host,
            next_hop_address=info.data_address,
            dst_host=info.host,
        )
        self.send(src, control_pb2.Directive(send=send))

    def Session(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        first = next(request_iterator)
        host, address = first.hello.host, first.hello.data_address
        out: queue.Queue[Any] = queue.Queue()
        with self.lock:
            self.sessions[host] = (out, address)

        def read() -> None:
            try:
                for message in request_iterator:
                    self._on_message(host, address, message)
            except grpc.RpcError:
                pass  # the stream ended
            out.put(None)

        threading.Thread(target=read, daemon=True).start()
        yield control_pb2.Directive(welcome=control_pb2.Welcome(policy="fake"))
        while True:
            directive = out.get()
            if directive is None:
                return
            yield directive

    def _on_message(self, host: str, address: str, m: Any) -> None:
        kind = m.WhichOneof("kind")
        if kind == "register_role":
            r = m.register_role
            with self.lock:
                self.registered.append((host, r.job, r.name))
            if r.role == control_pb2.ROLE_SERVER:
                info = control_pb2.ServerInfo(
                    name=r.name, host=host, data_address=address, model=r.model, version=r.version
                )
                with self.lock:
                    self.servers.setdefault(r.job, {})[r.name] = info
                    self.params[r.job] = r.params
                    others = [(h, out) for h, (out, _) in self.sessions.items() if h != host]
                    servers = list(self.servers[r.job].values())
                for _, out in others:
                    out.put(
                        control_pb2.Directive(job_update=control_pb2.JobUpdate(job=r.job, servers=servers))
                    )
                ack = control_pb2.RoleAck(request_id=r.request_id, ok=True, params=r.params, servers=servers)
            else:
                with self.lock:
                    servers = list(self.servers.get(r.job, {}).values())
                    params = self.params.get(r.job)
                if not servers:
                    ack = control_pb2.RoleAck(
                        request_id=r.request_id,
                        ok=False,
                        error=f"unknown job {r.job!r}",
                        code=control_pb2.ERROR_CODE_UNKNOWN_JOB,
                    )
                else:
                    ack = control_pb2.RoleAck(
                        request_id=r.request_id, ok=True, params=params, servers=servers
                    )
                    with self.lock:
                        self.accepted.append((host, r.job, r.name))
            self.send(host, control_pb2.Directive(role_ack=ack))
        elif kind == "update_ready":
            with self.lock:
                self.ready.append(m.update_ready)
                hold = self.hold
            if not hold:
                self.send_to_server(m.update_ready)
        elif kind == "transfer_report":
            with self.lock:
                self.reports.append(m.transfer_report)
        elif kind == "unregister_role":
            with self.lock:
                self.unregistered.append(m.unregister_role)


@pytest.fixture
def scheduler() -> Iterator[FakeScheduler]:
    sched = FakeScheduler()
    sched.start()
    yield sched
    sched.stop()


@pytest.fixture
def sockdir() -> Iterator[str]:
    # Unix socket paths must stay short (108 bytes): not under pytest's tmp_path.
    path = tempfile.mkdtemp(prefix="mlfd-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_daemon(scheduler: FakeScheduler, sockdir: str) -> Iterator[Any]:
    """``make_daemon(host, **config)`` starts an in-process daemon; all are stopped at the end."""
    daemons: list[Daemon] = []

    def make(host: str, **overrides: Any) -> Daemon:
        config = DaemonConfig(
            host=host,
            scheduler=scheduler.address,
            socket_path=os.path.join(sockdir, f"{host}.sock"),
            retry_backoff=0.05,
            **overrides,
        )
        daemon = Daemon(config)
        daemon.start(timeout=10)
        daemons.append(daemon)
        return daemon

    yield make
    for daemon in daemons:
        daemon.stop()
