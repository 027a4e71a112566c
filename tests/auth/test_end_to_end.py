"""A push through an mTLS scheduler and authenticated daemons works end to end (real processes)."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest

from mlfabric.daemon.channels.frames import FrameHeader, FrameLimits, recv_frame, send_frame
from mlfabric.daemon.channels.sockets import parse_address
from mlfabric.proto.v1 import dataplane_pb2
from tests.auth.authkit import Procs, push

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("data_auth", ["hmac", "tls"])
def test_push_through_an_authenticated_cluster(procs: Procs, certs: Path, data_auth: str) -> None:
    address = procs.scheduler(certs)
    for host in ("h0", "h1"):  # the daemons' settings from config files (the scheduler's: flags)
        config = procs.dir / f"{host}.toml"
        config.write_text(
            f'tls_ca = "{certs / "ca.pem"}"\ntls_cert = "{certs / f"{host}.pem"}"\n'
            f'tls_key = "{certs / f"{host}.key"}"\ndata_auth = "{data_auth}"\n'
            f'data_secret = "{certs / "dataplane.secret"}"\nlocal_peer_check = true\n'
        )
        procs.daemon(host, address, "--config", str(config))
    ready = {h: procs.ready(h) for h in ("h0", "h1")}
    result = push(ready["h0"]["socket"], ready["h1"]["socket"], 5)
    assert result == {"applied": 5, "dropped": 0, "reasons": []}

    # an unauthenticated peer on h0's data plane is refused with a reason, h0 carries on
    with socket.create_connection(parse_address(ready["h0"]["data_address"]), timeout=10) as sock:
        send_frame(
            sock, FrameHeader(kind=dataplane_pb2.FRAME_KIND_GET, job="ops", server="ps0", src_host="h1")
        )
        reply = recv_frame(sock, FrameLimits())
    assert reply is not None and reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
    assert "authentication required" in reply.header.reason
    assert "refused the connection from 127.0.0.1" in procs.log("h0")
    assert procs.procs["h0"].poll() is None
    assert push(ready["h0"]["socket"], ready["h1"]["socket"], 2)["applied"] == 2


def test_plaintext_cluster_unchanged(procs: Procs) -> None:
    """Auth off (the default): the same push, no certificates anywhere."""
    address = procs.scheduler(None)
    for host in ("h0", "h1"):
        procs.daemon(host, address)
    ready = {h: procs.ready(h) for h in ("h0", "h1")}
    assert push(ready["h0"]["socket"], ready["h1"]["socket"], 3)["applied"] == 3
    assert os.path.exists(ready["h0"]["socket"]) and struct.calcsize("3i") == 12
