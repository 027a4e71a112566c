"""``mlfabric certs`` writes a CA, host, scheduler and admin certificates that work together."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mlfabric.wire.auth import load_secret
from mlfabric.wire.tls import TlsFiles, cert_names, client_context, server_context


def files(d: Path, name: str) -> TlsFiles:
    return TlsFiles(str(d / "ca.pem"), str(d / f"{name}.pem"), str(d / f"{name}.key"))


def handshake(d: Path, server: str, client: str, client_dir: Path | None = None) -> frozenset[str]:
    """A mutual TLS handshake over a socket pair; the names the server sees in the client's cert."""
    a, b = socket.socketpair()
    got: list[frozenset[str]] = []
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            with server_context(files(d, server)).wrap_socket(a, server_side=True) as tls:
                got.append(cert_names(tls.getpeercert()))
                tls.recv(1)
        except OSError as exc:
            failures.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client_context(files(client_dir or d, client)).wrap_socket(b) as tls:
            tls.sendall(b"x")
    finally:
        thread.join(10)
        a.close()
        b.close()
    if failures:
        raise failures[0]
    return got[0]


def test_files_and_modes(certs: Path) -> None:
    names = {p.name for p in certs.iterdir()}
    for stem in ("ca", "h0", "h1", "127.0.0.1", "admin"):
        assert {f"{stem}.pem", f"{stem}.key"} <= names
        assert (certs / f"{stem}.key").stat().st_mode & 0o777 == 0o600
    assert (certs / "dataplane.secret").stat().st_mode & 0o777 == 0o600
    assert len(load_secret(str(certs / "dataplane.secret"))) == 32


def test_certificates_authenticate_each_other(certs: Path, other_certs: Path) -> None:
    assert handshake(certs, "h0", "h1") == {"h1"}
    assert handshake(certs, "127.0.0.1", "admin") == {"admin"}
    with pytest.raises(OSError, match="certificate"):  # another CA's h1 is a stranger
        handshake(certs, "h0", "h1", client_dir=other_certs)


def test_existing_files_kept_unless_forced(certs: Path) -> None:
    cmd = [sys.executable, "-m", "mlfabric", "certs", "--out", str(certs), "--hosts", "h0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "exists (use --force to overwrite)" in out.stderr


def test_missing_cryptography_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['cryptography'] = None\n"
        "import mlfabric, mlfabric.daemon.host, mlfabric.wire.auth  # the core needs no cryptography\n"
        "from mlfabric.cli import main\n"
        f"sys.exit(main(['certs', '--out', {str(tmp_path)!r}, '--hosts', 'h0']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "pip install 'mlfabric[auth]'" in out.stderr
    assert not list(tmp_path.iterdir())


def test_a_daemon_or_scheduler_reachable_beyond_loopback_without_auth_warns() -> None:
    """Issue 27: auth is off by default (fine on loopback); on another address, say so loudly.
    (The scheduler logs ``unauthenticated_warning("scheduler", ...)`` the same way.)"""
    from mlfabric.daemon.cli import unauthenticated_warnings
    from mlfabric.daemon.config import DaemonConfig
    from mlfabric.wire.auth import DataPlaneAuth, unauthenticated_warning

    assert unauthenticated_warnings(DaemonConfig("h0", "127.0.0.1:7077", "/tmp/s")) == []
    exposed = unauthenticated_warnings(
        DaemonConfig("h0", "127.0.0.1:7077", "/tmp/s", data_listen="0.0.0.0:0")
    )
    assert len(exposed) == 1 and "data plane on 0.0.0.0:0 without authentication" in exposed[0]
    hmac_on = DaemonConfig(
        "h0",
        "127.0.0.1:7077",
        "/tmp/s",
        data_listen="10.1.2.3:0",
        data_auth=DataPlaneAuth("hmac", "h0", secret=b"k" * 32),
    )
    assert unauthenticated_warnings(hmac_on) == []
    assert "scheduler on [::]:7077 without" in str(unauthenticated_warning("scheduler", "[::]:7077", "tls"))
