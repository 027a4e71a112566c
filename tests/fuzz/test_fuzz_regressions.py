"""Reproducers of what fuzzing the daemons found, each fixed (DESIGN §3).

The scheduler's findings (a role value the enum does not know; bytes that do not parse as a
``DaemonMessage``) are in ``test_fuzz_control.py``; the slow peers in ``test_limits.py``.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
import types
from typing import Any

import pytest

from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon
from mlfabric.proto.v1 import local_pb2

pytestmark = pytest.mark.slow


def test_a_waiting_registration_stops_when_its_process_disconnects(
    fuzz_cluster: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker registration for a job without a server retried every 0.2 s until ``wait_seconds``
    (the fuzzer sent 1e300) even after its connection closed: each such connection left a retry
    loop on the daemon's task pool for good."""
    directory = tempfile.mkdtemp(prefix="mlfr-")
    daemon = Daemon(
        DaemonConfig(
            host="fz", scheduler=fuzz_cluster.scheduler, socket_path=os.path.join(directory, "fz.sock")
        )
    )
    attempts: list[float] = []
    register = daemon.registrar.register

    def counting(message: Any, on_ack: Any) -> None:
        attempts.append(time.monotonic())
        register(message, on_ack)

    monkeypatch.setattr(daemon.registrar, "register", counting)
    daemon.start(timeout=10)
    try:
        request = local_pb2.LocalRequest(
            request_id=1,
            register_worker=local_pb2.RegisterWorkerRequest(job="nojob", name="x", wait_seconds=1e300),
        )
        body = request.SerializeToString()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(daemon.config.socket_path)
            sock.sendall(struct.pack(">I", len(body)) + body)
            deadline = time.monotonic() + 20  # a few retries while it is connected (a loaded CI: slow)
            while len(attempts) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert len(attempts) >= 2
        time.sleep(1.0)  # the daemon notices the close (and an attempt already started ends)
        closed_at = time.monotonic()
        time.sleep(1.0)
        later = [t for t in attempts if t > closed_at]
        assert later == [], f"{len(later)} registration attempts after the process disconnected"
    finally:
        daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)
