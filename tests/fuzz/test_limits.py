"""Slow-loris and idle-connection limits of a daemon, with real sockets (DESIGN §3).

A peer that opens a data-plane or local connection and sends nothing is closed after the
idle timeout; one that sends a frame header (or a local message) byte by byte is closed after
the header timeout; connections over the limit are refused. Each closing names its limit.
The listener and the local API server run in this process with short limits; the last tests
aim at the fuzz cluster's daemon processes, started with ``--idle-timeout 3 --header-timeout 1``.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import struct
import tempfile
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from mlfabric.daemon.channels.frames import (
    MAGIC,
    FrameError,
    FrameLimits,
    error_header,
    recv_frame,
    send_frame,
)
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.localapi import LocalApiServer
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.daemon.channels.sockets import parse_address
from mlfabric.proto.v1 import dataplane_pb2, local_pb2


def _connect(address: str) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=10)
    return sock


def _trickle(sock: socket.socket, data: bytes, every: float, until: float) -> int:
    """Send ``data`` one byte per ``every`` seconds until the peer answers or closes; bytes sent."""
    sent = 0
    deadline = time.monotonic() + until
    for byte in data:
        if time.monotonic() > deadline or select.select([sock], [], [], 0)[0]:
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        sent += 1
        time.sleep(every)
    return sent


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``sock`` within ``seconds`` (whatever it sends before)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


@pytest.fixture
def listener() -> Iterator[DataPlaneListener]:
    lst = DataPlaneListener(
        "127.0.0.1:0",
        lambda frame: Response(dataplane_pb2.FrameHeader(kind=dataplane_pb2.FRAME_KIND_ACK)),
        FrameLimits(),
        idle_timeout=0.5,
        header_timeout=0.5,
        max_connections=2,
    )
    lst.start()
    yield lst
    lst.stop()


def test_a_data_plane_header_sent_byte_by_byte_is_cut_off_naming_the_limit(
    listener: DataPlaneListener,
) -> None:
    assert listener.address is not None
    header = dataplane_pb2.FrameHeader(
        kind=dataplane_pb2.FRAME_KIND_GET, job="j", server="s"
    ).SerializeToString()
    with _connect(listener.address) as sock:
        sent = _trickle(sock, MAGIC + struct.pack(">I", len(header)) + header, every=0.1, until=5.0)
        assert sent < 8 + len(header), "the listener waited for the whole trickled header"
        reply = recv_frame(sock, FrameLimits())
        assert reply is not None and reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
        assert "header timeout" in reply.header.reason and "0.5 s" in reply.header.reason
        assert _closed_within(sock, 5)


def test_an_idle_data_plane_connection_is_closed(listener: DataPlaneListener) -> None:
    assert listener.address is not None
    with _connect(listener.address) as sock:
        assert _closed_within(sock, 5)
    assert listener.idle_closed == 1
    with _connect(listener.address) as sock:  # a connection that keeps busy is served
        for _ in range(3):
            send_frame(
                sock, dataplane_pb2.FrameHeader(kind=dataplane_pb2.FRAME_KIND_GET, job="j", server="s")
            )
            reply = recv_frame(sock, FrameLimits())
            assert reply is not None and reply.header.kind == dataplane_pb2.FRAME_KIND_ACK
            time.sleep(0.3)


def test_data_plane_connections_over_the_limit_are_refused_naming_it() -> None:
    lst = DataPlaneListener(
        "127.0.0.1:0",
        lambda frame: Response(dataplane_pb2.FrameHeader(kind=dataplane_pb2.FRAME_KIND_ACK)),
        FrameLimits(),
        max_connections=2,
    )
    address = lst.start()
    try:
        held = [_connect(address), _connect(address)]
        for sock in held:  # both served
            send_frame(sock, error_header("x"))
            assert recv_frame(sock, FrameLimits()) is not None
        with _connect(address) as third:
            reply = recv_frame(third, FrameLimits())
            assert reply is not None and reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
            assert "too many data-plane connections (limit 2)" in reply.header.reason
        assert lst.refused == 1
        held.pop().close()
        deadline = time.monotonic() + 5
        while lst.connections > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with _connect(address) as again:
            send_frame(again, error_header("x"))
            reply = recv_frame(again, FrameLimits())
            assert reply is not None and reply.header.kind == dataplane_pb2.FRAME_KIND_ACK
        for sock in held:
            sock.close()
    finally:
        lst.stop()


def test_the_peer_pool_retires_idle_connections_before_the_peer_closes_them(
    listener: DataPlaneListener,
) -> None:
    assert listener.address is not None
    pool = PeerPool(FrameLimits(), max_idle_seconds=0.25)
    try:
        get = dataplane_pb2.FrameHeader(kind=dataplane_pb2.FRAME_KIND_GET, job="j", server="s")
        for _ in range(4):  # idle 0.4 s each time: past the pool's 0.25 s, under the peer's 0.5 s
            assert pool.request(listener.address, get).header.kind == dataplane_pb2.FRAME_KIND_ACK
            time.sleep(0.4)
    finally:
        pool.close()


# ------------------------------------------------------------------ local API


@pytest.fixture
def local_server() -> Iterator[LocalApiServer]:
    directory = tempfile.mkdtemp(prefix="mlfl-")
    requests: list[Any] = []

    def on_request(conn: Any, request: Any, fd: int | None) -> None:
        requests.append(request)
        if fd is not None:
            os.close(fd)
        conn.error(request.request_id, "bad_request", "test server")

    server = LocalApiServer(
        os.path.join(directory, "d.sock"),
        on_request,
        lambda conn: None,
        idle_timeout=0.5,
        message_timeout=0.5,
        max_connections=2,
    )
    server.start()
    yield server
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)


def _local_events(sock: socket.socket, seconds: float = 5.0) -> list[Any]:
    """Every event until the daemon closes the connection."""
    sock.settimeout(seconds)
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    events = []
    while buf:
        (n,) = struct.unpack(">I", buf[:4])
        events.append(local_pb2.LocalEvent.FromString(buf[4 : 4 + n]))
        buf = buf[4 + n :]
    return events


def _unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def test_a_local_connection_that_sends_nothing_is_closed_naming_the_limit(
    local_server: LocalApiServer,
) -> None:
    with _unix(local_server.path) as sock:
        events = _local_events(sock)
    assert [e.error.code for e in events] == ["timeout"]
    assert "idle timeout" in events[0].error.message and "0.5 s" in events[0].error.message


def test_a_local_message_sent_byte_by_byte_is_cut_off_naming_the_limit(local_server: LocalApiServer) -> None:
    body = local_pb2.LocalRequest(request_id=7, get=local_pb2.GetRequest(server="s")).SerializeToString()
    with _unix(local_server.path) as sock:
        sent = _trickle(sock, struct.pack(">I", len(body)) + body, every=0.1, until=5.0)
        assert sent < 4 + len(body)
        events = _local_events(sock)
    assert [e.error.code for e in events] == ["timeout"]
    assert "message timeout" in events[0].error.message


def test_a_registered_process_may_stay_quiet(local_server: LocalApiServer) -> None:
    body = local_pb2.LocalRequest(request_id=7, get=local_pb2.GetRequest(server="s")).SerializeToString()
    with _unix(local_server.path) as sock:
        sock.sendall(struct.pack(">I", len(body)) + body)
        time.sleep(1.0)  # twice the idle timeout after its first message
        sock.sendall(struct.pack(">I", len(body)) + body)
        sock.shutdown(socket.SHUT_WR)
        events = _local_events(sock)
    assert [e.request_id for e in events] == [7, 7]


def test_local_connections_over_the_limit_are_refused_naming_it(local_server: LocalApiServer) -> None:
    body = local_pb2.LocalRequest(request_id=1, get=local_pb2.GetRequest(server="s")).SerializeToString()
    held = [_unix(local_server.path), _unix(local_server.path)]
    for sock in held:
        sock.sendall(struct.pack(">I", len(body)) + body)  # past the idle timeout: kept
    time.sleep(0.2)
    with _unix(local_server.path) as third:
        events = _local_events(third)
    assert [e.error.code for e in events] == ["unavailable"]
    assert "too many local connections to this daemon (limit 2)" in events[0].error.message
    assert local_server.refused == 1
    for sock in held:
        sock.close()


# ------------------------------------------------------------------ the daemon processes


@pytest.mark.slow
def test_daemon_processes_close_slow_and_idle_peers(fuzz_cluster: types.SimpleNamespace, fz: Any) -> None:
    """``mlfabric daemon --idle-timeout 3 --header-timeout 1``: both listeners enforce them."""
    with _connect(fuzz_cluster.ps_data) as sock:  # data plane, header byte by byte
        sent = _trickle(sock, MAGIC + struct.pack(">I", 64) + b"\x08" * 64, every=0.2, until=10.0)
        assert sent < 72
        try:
            reply = recv_frame(sock, FrameLimits())
        except (FrameError, ConnectionResetError):
            reply = None
        assert reply is None or "header timeout" in reply.header.reason
        assert _closed_within(sock, 5)
    start = time.monotonic()
    with _connect(fuzz_cluster.ps_data) as sock:  # data plane, idle
        assert _closed_within(sock, 10)
    assert time.monotonic() - start >= 2.5
    with _unix(fuzz_cluster.w0_socket) as sock:  # local socket, idle
        events = _local_events(sock, 10)
    assert [e.error.code for e in events] == ["timeout"] and "idle timeout" in events[0].error.message
    fz.healthy(fuzz_cluster)
