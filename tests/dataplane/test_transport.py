"""Listener and peer pool (daemon/channels/listener.py, peers.py) against real sockets on 127.0.0.1:0."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from mlfabric.daemon.channels.frames import (
    MAGIC,
    Frame,
    FrameHeader,
    FrameLimits,
    error_header,
    recv_frame,
)
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.peers import PeerPool, PeerUnavailable, parse_address
from mlfabric.daemon.channels.ratelimit import TokenBucket
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=64 << 20)
MODEL = np.arange(1000, dtype=np.float64)


class Server:
    """A handler that records updates, ACKs them with a version and answers GET with MODEL."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

    def __call__(self, frame: Frame) -> Response:
        h = frame.header
        if h.kind == dataplane_pb2.FRAME_KIND_UPDATE:
            if h.job == "boom":
                raise RuntimeError("handler bug")
            if h.job == "bad-reply":  # a MODEL whose layout does not match its payload
                bad = FrameHeader(kind=dataplane_pb2.FRAME_KIND_MODEL)
                bad.tensors.add(name="m", dtype="float64", shape=[2], offset=0, nbytes=16)
                return Response(bad, b"123")
            with self.lock:
                self.updates.append((h.update_id, bytes(frame.payload)))
                version = len(self.updates)
            return Response(
                FrameHeader(
                    kind=dataplane_pb2.FRAME_KIND_ACK,
                    update_id=h.update_id,
                    outcome=control_pb2.OUTCOME_APPLIED,
                    version=version,
                )
            )
        if h.kind == dataplane_pb2.FRAME_KIND_GET:
            model = FrameHeader(kind=dataplane_pb2.FRAME_KIND_MODEL, version=len(self.updates))
            model.tensors.add(name="m", dtype="float64", shape=[MODEL.size], offset=0, nbytes=MODEL.nbytes)
            return Response(model, MODEL.tobytes())
        return Response(error_header(f"unexpected frame kind {h.kind}"))


@pytest.fixture
def server() -> Server:
    return Server()


@pytest.fixture
def listener(server: Server) -> Iterator[DataPlaneListener]:
    lst = DataPlaneListener("127.0.0.1:0", server, LIMITS, io_timeout=10)
    lst.start()
    yield lst
    lst.stop()


@pytest.fixture
def pool() -> Iterator[PeerPool]:
    p = PeerPool(LIMITS, connect_timeout=2, io_timeout=10)
    yield p
    p.close()


def update(update_id: str, data: bytes, job: str = "j") -> FrameHeader:
    h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id=update_id, job=job, server="s")
    h.tensors.add(name="w", dtype="uint8", shape=[len(data)], offset=0, nbytes=len(data))
    return h


def raw_exchange(address: str, wire: bytes) -> FrameHeader | None:
    """Write raw bytes to the listener and return the reply frame's header (None: closed silently)."""
    with socket.create_connection(parse_address(address), timeout=10) as sock:
        sock.sendall(wire)
        sock.shutdown(socket.SHUT_WR)
        frame = recv_frame(sock, LIMITS)
        assert sock.recv(1) == b""  # and then the listener closed the connection
        return None if frame is None else frame.header


def test_update_ack_and_get_model(listener: DataPlaneListener, pool: PeerPool, server: Server) -> None:
    assert listener.address is not None
    data = bytes(range(256)) * 1000
    reply = pool.request(listener.address, update("u1", data), data)
    assert reply.header.kind == dataplane_pb2.FRAME_KIND_ACK
    assert (reply.header.update_id, reply.header.version) == ("u1", 1)
    assert reply.sent.bytes == len(data) and reply.sent.end >= reply.sent.start > 0
    assert server.updates == [("u1", data)]
    model = pool.request(listener.address, FrameHeader(kind=dataplane_pb2.FRAME_KIND_GET, job="j"))
    assert model.header.kind == dataplane_pb2.FRAME_KIND_MODEL
    np.testing.assert_array_equal(np.frombuffer(model.payload, np.float64), MODEL)
    assert model.received.bytes == MODEL.nbytes


def test_connection_reused(listener: DataPlaneListener, pool: PeerPool) -> None:
    assert listener.address is not None
    for i in range(5):
        pool.request(listener.address, update(f"u{i}", b"x"), b"x")
    conn = pool.acquire(listener.address)
    assert not conn.closed
    with pool._lock:  # one connection served all five requests
        assert sum(len(v) for v in pool._idle.values()) == 0
    pool.release(conn)


def test_concurrent_senders_and_zero_byte_update(
    listener: DataPlaneListener, pool: PeerPool, server: Server
) -> None:
    assert listener.address is not None
    address = listener.address
    errors: list[BaseException] = []

    def push(i: int) -> None:
        data = bytes([i]) * (i * 10000)
        try:
            reply = pool.request(address, update(f"u{i}", data), data)
            assert reply.header.update_id == f"u{i}"
        except BaseException as exc:
            errors.append(exc)
            raise

    threads = [threading.Thread(target=push, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(server.updates) == [(f"u{i}", bytes([i]) * (i * 10000)) for i in range(6)]


def bad_header_frame(hlen: int, body: bytes) -> bytes:
    return MAGIC + struct.pack(">I", hlen) + body


def framed(header: FrameHeader, payload: bytes) -> bytes:
    raw = header.SerializeToString()
    return MAGIC + struct.pack(">I", len(raw)) + raw + payload


def with_fields(header: FrameHeader, **fields: int) -> FrameHeader:
    for key, value in fields.items():
        setattr(header, key, value)
    return header


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (b"\x16\x03\x01\x02\x00\x01\x00\x01", None),  # a TLS hello: not our protocol, closed silently
        (bad_header_frame(1 << 20, b""), "header of 1048576 bytes exceeds the limit of 4096"),
        (bad_header_frame(2, b"\x08\xff"), "header does not parse"),
        (framed(with_fields(update("u", b"0" * 4), payload_bytes=1 << 30), b""), "exceeds the limit"),
        (framed(with_fields(update("u", b"0" * 4), payload_bytes=5), b"0" * 5), "covers 4 bytes"),
        (framed(with_fields(update("u", b"0" * 4), payload_bytes=4), b"0" * 4), "CRC-32 mismatch"),
        (
            framed(
                with_fields(update("u", b"0" * 4), payload_bytes=4, payload_crc32=zlib.crc32(b"0" * 4)), b"00"
            ),
            None,  # peer closed mid-frame: nothing to answer
        ),
    ],
)
def test_bad_frames_are_rejected_and_listener_keeps_serving(
    listener: DataPlaneListener,
    pool: PeerPool,
    server: Server,
    wire: bytes,
    reason: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert listener.address is not None
    with caplog.at_level(logging.WARNING, logger="mlfabric.daemon.transport"):
        header = raw_exchange(listener.address, wire)
    if reason is None:
        assert header is None
    else:
        assert header is not None and header.kind == dataplane_pb2.FRAME_KIND_ERROR
        assert reason in header.reason
    assert any("rejected frame" in r.getMessage() for r in caplog.records)
    assert listener.rejected == 1
    assert server.updates == []  # nothing reached the handler
    reply = pool.request(listener.address, update("good", b"ok"), b"ok")  # the next client is served
    assert reply.header.kind == dataplane_pb2.FRAME_KIND_ACK and server.updates == [("good", b"ok")]


def test_handler_exception_answers_error(listener: DataPlaneListener, pool: PeerPool) -> None:
    assert listener.address is not None
    reply = pool.request(listener.address, update("u1", b"x", job="boom"), b"x")
    assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
    assert "handler bug" in reply.header.reason and reply.header.update_id == "u1"
    assert pool.request(listener.address, update("u2", b"y"), b"y").header.version == 1


def test_malformed_handler_reply_answers_error(listener: DataPlaneListener, pool: PeerPool) -> None:
    assert listener.address is not None
    reply = pool.request(listener.address, update("u1", b"x", job="bad-reply"), b"x")
    assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
    assert "bad reply" in reply.header.reason and "out of range" in reply.header.reason
    assert pool.request(listener.address, update("u2", b"y"), b"y").header.version == 1


def free_port_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_connect_refused_names_the_address(pool: PeerPool) -> None:
    address = free_port_address()
    with pytest.raises(PeerUnavailable, match=f"peer {address} unavailable: connect") as info:
        pool.request(address, update("u", b"x"), b"x")
    assert info.value.address == address and not info.value.sent


class VanishingPeer:
    """A raw peer that reads ``read_bytes`` bytes of the first connection and then closes it."""

    def __init__(self, read_bytes: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.read_bytes = read_bytes
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        got = 0
        while got < self.read_bytes:
            chunk = conn.recv(min(65536, self.read_bytes - got))
            if not chunk:
                break
            got += len(chunk)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        conn.close()

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


def test_peer_vanishes_mid_transfer(pool: PeerPool) -> None:
    peer = VanishingPeer(read_bytes=100_000)
    data = b"z" * (32 << 20)
    try:
        with pytest.raises(PeerUnavailable, match=f"peer {peer.address} unavailable: send failed"):
            pool.request(peer.address, update("u", data), data)
    finally:
        peer.close()


def test_peer_vanishes_before_reply(pool: PeerPool) -> None:
    data = b"z" * 1000
    peer = VanishingPeer(read_bytes=len(framed(update("u", data), b"")) + 8 + len(data))
    try:
        with pytest.raises(PeerUnavailable) as info:
            pool.request(peer.address, update("u", data), data)
    finally:
        peer.close()
    assert info.value.sent  # the update may have arrived: the daemon must not blindly resend
    assert peer.address in str(info.value)


def test_stale_idle_connection_is_replaced(server: Server, pool: PeerPool) -> None:
    """A peer that restarted (closed our idle connection) is reconnected to, not failed on."""
    first = DataPlaneListener("127.0.0.1:0", server, LIMITS)
    address = first.start()
    pool.request(address, update("u1", b"a"), b"a")
    first.stop()
    second = DataPlaneListener(address, server, LIMITS)  # same address, new process in real life
    second.start()
    try:
        time.sleep(0.05)
        assert pool.request(address, update("u2", b"b"), b"b").header.version == 2
    finally:
        second.stop()


def test_stop_closes_connections_and_port(server: Server, pool: PeerPool) -> None:
    lst = DataPlaneListener("127.0.0.1:0", server, LIMITS)
    address = lst.start()
    pool.request(address, update("u1", b"a"), b"a")
    lst.stop()
    assert lst._conns == {}
    with pytest.raises(PeerUnavailable):
        pool.request(address, update("u2", b"b"), b"b")


@pytest.mark.parametrize("side", ["ingress", "egress"])
def test_token_bucket_limits_real_transfer(server: Server, side: str) -> None:
    rate = 20e6
    bucket = TokenBucket(rate, burst=256 * 1024)
    lst = DataPlaneListener(
        "127.0.0.1:0", server, LIMITS, ingress_bucket=bucket if side == "ingress" else None
    )
    address = lst.start()
    p = PeerPool(LIMITS, egress_bucket=bucket if side == "egress" else None, io_timeout=10)
    data = b"r" * (8 << 20)
    try:
        t0 = time.monotonic()
        reply = p.request(address, update("u", data), data)
        elapsed = time.monotonic() - t0
    finally:
        p.close()
        lst.stop()
    assert reply.header.kind == dataplane_pb2.FRAME_KIND_ACK
    expected = len(data) / rate  # 0.42 s
    assert 0.7 * expected < elapsed < 1.3 * expected + 0.3  # loosely: a shared, loaded machine


def test_allocation_failure_answers_error(server: Server, pool: PeerPool) -> None:
    def alloc(n: int) -> bytearray:
        if n > 1000:
            raise MemoryError
        return bytearray(n)

    lst = DataPlaneListener("127.0.0.1:0", server, LIMITS, alloc=alloc)
    address = lst.start()
    try:
        big = b"b" * 5000
        reply = pool.request(address, update("big", big), big)
        assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
        assert "cannot allocate 5000 bytes for update 'big'" in reply.header.reason
        assert pool.request(address, update("small", b"s"), b"s").header.kind == dataplane_pb2.FRAME_KIND_ACK
    finally:
        lst.stop()
