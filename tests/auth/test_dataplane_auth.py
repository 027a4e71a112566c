"""Data-plane authentication: HMAC handshake and mutual TLS between a listener and a peer pool.

Real TCP sockets on 127.0.0.1 (port 0). Unauthenticated peers, peers with the wrong secret or
another CA's certificate, and frames sent in another host's name are refused with a logged
reason; the listener keeps serving the authenticated ones, memfd payloads included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlfabric.daemon.channels.frames import FileSpan, Frame, FrameHeader, FrameLimits, error_header
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.peers import PeerPool, PeerUnavailable
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.wire.auth import DataPlaneAuth, load_secret
from mlfabric.wire.tls import TlsFiles

_UPDATE, _ACK, _ERROR = (
    dataplane_pb2.FRAME_KIND_UPDATE,
    dataplane_pb2.FRAME_KIND_ACK,
    dataplane_pb2.FRAME_KIND_ERROR,
)


Served = tuple[DataPlaneListener, str, list[str]]


def files(certs: Path, host: str) -> TlsFiles:
    return TlsFiles(str(certs / "ca.pem"), str(certs / f"{host}.pem"), str(certs / f"{host}.key"))


def auth(mode: str, host: str, certs: Path) -> DataPlaneAuth:
    secret = load_secret(str(certs / "dataplane.secret")) if mode == "hmac" else None
    return DataPlaneAuth(mode, host, secret, files(certs, host) if mode == "tls" else None, timeout=5.0)


@pytest.fixture(params=["hmac", "tls"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def served(mode: str, certs: Path) -> Iterator[Served]:
    """A listener of h0 authenticating with ``mode``; it ACKs each UPDATE, recording its src_host."""
    seen: list[str] = []

    def handler(frame: Frame) -> Response:
        seen.append(frame.header.src_host)
        assert bytes(frame.payload) == b"x" * frame.header.payload_bytes
        frame.payload.release()
        return Response(FrameHeader(kind=_ACK, update_id=frame.header.update_id))

    listener = DataPlaneListener("127.0.0.1:0", handler, FrameLimits(), auth=auth(mode, "h0", certs))
    address = listener.start()
    try:
        yield listener, address, seen
    finally:
        listener.stop()


def update(src_host: str, n: int = 1000) -> FrameHeader:
    h = FrameHeader(kind=_UPDATE, update_id=f"{src_host}/1", src_host=src_host, job="j", server="s")
    h.tensors.add(name="w", dtype="uint8", shape=[n], offset=0, nbytes=n)
    return h


def test_authenticated_peer_is_served(served: Served, mode: str, certs: Path) -> None:
    listener, address, seen = served
    pool = PeerPool(FrameLimits(), connect_timeout=5, io_timeout=10, auth=auth(mode, "h1", certs))
    try:
        assert pool.request(address, update("h1"), b"x" * 1000).header.kind == _ACK
        fd = os.memfd_create("auth-test")
        os.write(fd, b"x" * (4 << 20))  # a memfd payload: sendfile with hmac, through TLS with tls
        try:
            reply = pool.request(address, update("h1", 4 << 20), FileSpan(fd, 0, 4 << 20))
        finally:
            os.close(fd)
        assert reply.header.kind == _ACK
        unnamed = update("h1", 10)
        unnamed.src_host = ""  # no src_host: the authenticated one is stamped on
        assert pool.request(address, unnamed, b"x" * 10).header.kind == _ACK
    finally:
        pool.close()
    assert seen == ["h1", "h1", "h1"]
    assert listener.auth_refused == 0


def test_unauthenticated_peer_refused(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    listener, address, seen = served
    pool = PeerPool(FrameLimits(), connect_timeout=5, io_timeout=10)  # no auth
    caplog.set_level(logging.WARNING)
    try:
        reply = pool.request(address, update("h1"), b"x" * 1000)
    finally:
        pool.close()
    assert reply.header.kind == _ERROR
    assert "authentication required" in reply.header.reason
    assert listener.auth_refused == 1 and seen == []
    assert any("refused the connection from 127.0.0.1" in r.getMessage() for r in caplog.records)


def test_wrong_credentials_refused(served: Served, mode: str, certs: Path, other_certs: Path) -> None:
    """Another cluster's secret (hmac) or another CA's certificate (tls) gets nowhere."""
    listener, address, seen = served
    pool = PeerPool(FrameLimits(), connect_timeout=5, io_timeout=10, auth=auth(mode, "h1", other_certs))
    try:
        with pytest.raises(PeerUnavailable, match="authentication"):
            pool.request(address, update("h1"), b"x" * 1000)
    finally:
        pool.close()
    assert seen == []
    deadline = time.monotonic() + 10  # the listener sees the failed handshake on its own thread
    while listener.auth_refused == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert listener.auth_refused == 1


def test_frame_in_another_hosts_name_refused(served: Served, mode: str, certs: Path) -> None:
    """h1, authenticated, may not send in h0's name: ERROR naming both, connection closed."""
    listener, address, seen = served
    pool = PeerPool(FrameLimits(), connect_timeout=5, io_timeout=10, auth=auth(mode, "h1", certs))
    try:
        reply = pool.request(address, update("h0"), b"x" * 1000)
        assert reply.header.kind == _ERROR
        assert "claims host 'h0'" in reply.header.reason and "authenticated as h1" in reply.header.reason
        assert pool.request(address, update("h1"), b"x" * 1000).header.kind == _ACK  # a new connection
    finally:
        pool.close()
    assert seen == ["h1"] and listener.auth_refused == 1


def test_hmac_needs_a_secret_and_tls_needs_files(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs data_secret"):
        DataPlaneAuth("hmac", "h0")
    with pytest.raises(ValueError, match="needs tls_ca"):
        DataPlaneAuth("tls", "h0")
    (tmp_path / "short").write_text("abcd\n")
    with pytest.raises(ValueError, match="need at least 16"):
        load_secret(str(tmp_path / "short"))
    assert error_header("x").kind == _ERROR


class _Tamperer:
    """An on-path TCP relay between a peer and the listener that flips one byte of the peer's
    stream at offset ``at`` (past the handshake, inside the first frame's payload)."""

    def __init__(self, target: str, at: int) -> None:
        host, _, port = target.rpartition(":")
        self._target, self._at = (host, int(port)), at
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.flipped = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        t = threading.Thread(target=self._serve, daemon=True)
        t.start()
        self._threads.append(t)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            peer, _ = self._sock.accept()
            upstream = socket.create_connection(self._target, timeout=10)
            back = threading.Thread(target=self._pump, args=(upstream, peer, False), daemon=True)
            back.start()
            self._threads.append(back)
            self._pump(peer, upstream, True)

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while received := src.recv(65536):
                data = bytearray(received)
                if tamper and not self.flipped and seen <= self._at < seen + len(data):
                    data[self._at - seen] ^= 0x01
                    self.flipped = True
                seen += len(data)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._sock.close()
        for t in self._threads:
            t.join(5)


def test_a_frame_modified_inside_an_authenticated_connection_is_refused(
    served: Served, mode: str, certs: Path
) -> None:
    """Issue 27: bytes changed on the path after the handshake never reach the handler.

    ``tls``: the record's MAC fails, the listener drops the connection (a deliberate forgery
    too: the attacker holds no key). ``hmac`` authenticates the connection only: a changed byte
    is refused by the payload's CRC-32 (ERROR naming it), which catches corruption, not a
    forger who fixes the CRC up -- docs/security.md says to use ``tls`` against on-path
    attackers.
    """
    _listener, address, seen = served
    relay = _Tamperer(address, at=512 * 1024)  # well past either handshake, inside the payload
    relay.start()
    pool = PeerPool(FrameLimits(), connect_timeout=5, io_timeout=10, auth=auth(mode, "h1", certs))
    try:
        if mode == "tls":
            with pytest.raises(PeerUnavailable):
                pool.request(relay.address, update("h1", 1 << 20), b"x" * (1 << 20))
        else:
            reply = pool.request(relay.address, update("h1", 1 << 20), b"x" * (1 << 20))
            assert reply.header.kind == _ERROR and "CRC" in reply.header.reason, reply.header.reason
    finally:
        pool.close()
        relay.stop()
    assert relay.flipped
    assert seen == []  # the handler never saw the modified frame
