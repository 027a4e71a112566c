"""mTLS on the control plane: who may register as a daemon, and ``mlfabric status`` over TLS.

A real scheduler process serving mTLS (port 0); daemons and clients as real processes or
gRPC clients of this test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from mlfabric.proto.v1 import control_pb2, control_pb2_grpc
from mlfabric.wire.tls import TlsFiles, grpc_channel
from tests.auth.authkit import Procs, tls_args

pytestmark = pytest.mark.timeout(180)


def hello(address: str, certs: Path, cert: str, host: str) -> grpc.RpcError | None:
    """Say Hello as ``host`` with ``cert``'s certificate; the error the scheduler answers with."""
    files = TlsFiles(str(certs / "ca.pem"), str(certs / f"{cert}.pem"), str(certs / f"{cert}.key"))
    with grpc_channel(address, files) as channel:
        stub = control_pb2_grpc.SchedulerStub(channel)
        messages = iter(
            [control_pb2.DaemonMessage(hello=control_pb2.Hello(host=host, data_address="127.0.0.1:9"))]
        )
        try:
            first = next(iter(stub.Session(messages, timeout=20)))
        except grpc.RpcError as exc:
            return exc
    assert first.WhichOneof("kind") == "welcome"
    return None


def test_daemon_may_speak_only_for_its_own_host(procs: Procs, certs: Path, other_certs: Path) -> None:
    address = procs.scheduler(certs)
    assert hello(address, certs, "h0", "h0") is None
    error = hello(address, certs, "h1", "h0")
    assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Hello names host 'h0'" in error.details() and "certificate names h1" in error.details()
    # another CA's certificate for the right name: no TLS session at all
    error = hello(address, other_certs, "h0", "h0")
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE

    # a daemon process with h1's certificate claiming h0 stops at once, naming both
    procs.daemon("h0", address, *tls_args(certs, "h1"), name="liar")
    assert procs.procs["liar"].wait(60) == 1
    log = procs.log("liar")
    assert "PERMISSION_DENIED" in log and "'h0'" in log and "certificate names h1" in log
    # a daemon without a certificate cannot reach a TLS scheduler
    procs.daemon("h1", address, "--connect-timeout", "3", name="plain")
    assert procs.procs["plain"].wait(60) == 1
    assert "did not welcome host 'h1'" in procs.log("plain")
    assert procs.procs["scheduler"].poll() is None


def test_status_over_tls(procs: Procs, certs: Path) -> None:
    address = procs.scheduler(certs)
    procs.daemon("h0", address, *tls_args(certs, "h0"))
    procs.ready("h0")
    base = [sys.executable, "-m", "mlfabric", "status", "--scheduler", address, "--json", "--timeout", "20"]
    ok = subprocess.run([*base, *tls_args(certs, "admin")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert '"h0"' in ok.stdout and "SERVING" in ok.stdout
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    # it says why: the scheduler serves mTLS and wants a certificate (issue 27 item 10)
    assert "serves mutual TLS: it needs a client certificate" in refused.stderr, refused.stderr
    assert "--tls-cert" in refused.stderr
    # a host's certificate is of the CA but not an admin's: refused, naming what is needed
    host = subprocess.run([*base, *tls_args(certs, "h0")], capture_output=True, text=True, timeout=60)
    assert host.returncode == 1 and "PERMISSION_DENIED" in host.stderr, host.stderr
    assert "needs an admin certificate" in host.stderr and "names h0" in host.stderr
    trace = subprocess.run(
        [sys.executable, "-m", "mlfabric", "trace", "--scheduler", address, "--seconds", "1",
         "--out", str(procs.dir / "t.json"), "--timeout", "20", *tls_args(certs, "h0")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert trace.returncode != 0 and "PERMISSION_DENIED" in trace.stderr, trace.stderr
    half = subprocess.run(
        [*base, "--tls-ca", str(certs / "ca.pem")], capture_output=True, text=True, timeout=60
    )
    assert half.returncode == 2 and "missing: tls_cert, tls_key" in half.stderr
