"""The scheduler and a daemon speak sd_notify to ``$NOTIFY_SOCKET`` (no systemd needed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


class NotifyListener:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(30)

    def until(self, field: str) -> list[str]:
        """Messages received up to and including the first one holding ``field``."""
        seen = []
        while True:
            message = self.sock.recv(4096).decode()
            seen.append(message)
            if field in message.split("\n"):
                return seen


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[NotifyListener]:
    n = NotifyListener(tmp_path / "notify")
    yield n
    n.sock.close()


def _start(args: list[str], listener: NotifyListener, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "400000"}
    with log.open("wb") as err:
        return subprocess.Popen([sys.executable, "-m", "mlfabric", *args], env=env, stderr=err)


def test_scheduler_ready_watchdog_reload_stopping(listener: NotifyListener, tmp_path: Path) -> None:
    proc = _start(["scheduler", "--listen", "127.0.0.1:0", "--star", "2"], listener, tmp_path / "s.log")
    try:
        ready = listener.until("READY=1")[-1]
        assert "STATUS=serving on 127.0.0.1:" in ready
        listener.until("WATCHDOG=1")
        listener.until("WATCHDOG=1")  # again: pinged from the loop, not once
        proc.send_signal(signal.SIGHUP)
        listener.until("RELOADING=1")
        assert any(
            line.startswith("STATUS=policy fair; 2 hosts")
            for line in listener.until("READY=1")[-1].split("\n")
        )
        proc.send_signal(signal.SIGTERM)
        listener.until("STOPPING=1")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_daemon_ready_only_once_welcomed(listener: NotifyListener, tmp_path: Path) -> None:
    sched = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlfabric",
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--star",
            "2",
            "--ready-file",
            str(tmp_path / "s.json"),
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "s.json").exists():
            assert sched.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        address = json.loads((tmp_path / "s.json").read_text())["address"]
        daemon = _start(
            [
                "daemon",
                "--host",
                "h0",
                "--scheduler",
                address,
                "--socket",
                str(tmp_path / "h0.sock"),
                "--ready-file",
                str(tmp_path / "h0.json"),
            ],
            listener,
            tmp_path / "d.log",
        )
        try:
            ready = listener.until("READY=1")[-1]
            assert (tmp_path / "h0.json").exists()  # written before READY=1
            assert f"scheduler {address}" in ready
            listener.until("WATCHDOG=1")
            daemon.send_signal(signal.SIGTERM)
            listener.until("STOPPING=1")
            assert daemon.wait(30) == 0
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
    finally:
        sched.terminate()
        sched.wait(30)
