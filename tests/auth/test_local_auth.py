"""The local socket checks its clients' uid/gid (SO_PEERCRED) when ``--local-peer-check`` is on.

A real daemon (and scheduler); clients are forked processes that switch to another user (needs root).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from pathlib import Path

import pytest

from mlfabric.proto.v1 import local_pb2
from mlfabric.wire.framing import send_message
from mlfabric.wire.peercred import LocalAccess, PeerCred
from tests.auth.authkit import Procs

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="running clients as another user needs root"),
]

NOBODY, USERS = 65534, 100


def client(sock: str, group: int) -> bytes:
    """What the daemon at ``sock`` answers a forked child running as uid nobody, gid ``group``.

    The child asks to register a worker of a job nobody serves (a request any admitted client
    gets an answer to) and returns the raw reply bytes; the child only uses modules loaded
    here, since after ``setuid`` it cannot read this Python's files.
    """
    request = local_pb2.LocalRequest(
        request_id=7, register_worker=local_pb2.RegisterWorkerRequest(job="nojob")
    )
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, then talk to the daemon
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(group)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(sock)
                with contextlib.suppress(OSError):  # refused: the daemon may have closed already
                    send_message(conn, request)
                os.write(write, conn.recv(65536))
            code = 0
        except OSError as exc:  # the parent's assertion shows what went wrong
            os.write(write, f"child failed: {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    return answer


def test_peer_check(procs: Procs) -> None:
    address = procs.scheduler(None)
    with tempfile.TemporaryDirectory(prefix="mlfabric-auth-") as public:
        os.chmod(public, 0o755)
        strict = str(Path(public) / "strict.sock")
        grouped = str(Path(public) / "grouped.sock")
        procs.daemon("h0", address, "--local-peer-check", "--socket", strict)
        procs.daemon("h1", address, "--local-peer-check", "--local-group", "users", "--socket", grouped)
        for h, sock in (("h0", strict), ("h1", grouped)):
            procs.ready(h)
            os.chmod(sock, 0o777)  # the file lets everyone in: SO_PEERCRED is what refuses
        refused = client(strict, NOBODY)
        assert b"permission_denied" in refused, refused
        assert f"uid {NOBODY}".encode() in refused and b"no local_group set" in refused
        assert "local API access denied" in procs.log("h0")
        admitted = client(grouped, USERS)  # in the allowed group: its request is answered
        assert b"permission_denied" not in admitted and b"nojob" in admitted, admitted
        assert b"permission_denied" in client(grouped, NOBODY)
        assert procs.procs["h0"].poll() is None and procs.procs["h1"].poll() is None


def test_local_access_rules() -> None:
    access = LocalAccess.for_group("users")
    assert access.refusal(PeerCred(1, os.getuid(), 12345)) is None  # the daemon's own uid
    assert access.refusal(PeerCred(1, 0, 0)) is None  # root
    assert access.refusal(PeerCred(1, NOBODY, USERS)) is None  # primary group
    assert "group users (100)" in str(access.refusal(PeerCred(1, NOBODY, NOBODY)))
    with pytest.raises(ValueError, match="no group 'no-such-group-here'"):
        LocalAccess.for_group("no-such-group-here")
