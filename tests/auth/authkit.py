"""Helpers of the authentication tests: test certificates and a cluster of real processes
(fixtures in conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPS = Path(__file__).resolve().parent.parent / "ops"
TOPOLOGY = (
    'hosts = ["h0", "h1"]\nswitches = ["sw"]\n'
    'links = [{a = "h0", b = "sw", gbps = 10}, {a = "h1", b = "sw", gbps = 10}]\n'
)


def make_certs(out: Path, hosts: str = "h0,h1") -> Path:
    """Run ``mlfabric certs`` (the command, as users do) into ``out``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mlfabric",
            "certs",
            "--out",
            str(out),
            "--hosts",
            hosts,
            "--scheduler",
            "127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return out


def tls_args(certs: Path, name: str) -> list[str]:
    """``--tls-ca/--tls-cert/--tls-key`` of ``name``'s files in ``certs``."""
    return [
        "--tls-ca",
        str(certs / "ca.pem"),
        "--tls-cert",
        str(certs / f"{name}.pem"),
        "--tls-key",
        str(certs / f"{name}.key"),
    ]


@dataclass
class Procs:
    """Processes started by a test (stopped by pid at teardown) and their logs."""

    dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.dir / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "mlfabric", "--log-level", "INFO", *args], stderr=log)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def ready(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        path, proc = self.dir / f"{name}.json", self.procs[name]
        deadline = time.monotonic() + timeout
        while not path.exists():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            assert time.monotonic() < deadline, f"{name}: no ready file after {timeout} s"
            time.sleep(0.05)
        return dict(json.loads(path.read_text()))

    def scheduler(self, certs: Path | None) -> str:
        """Start a scheduler (mTLS with ``certs``); its address."""
        (self.dir / "topo.toml").write_text(TOPOLOGY)
        args = [
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--topology",
            str(self.dir / "topo.toml"),
            "--ready-file",
            str(self.dir / "scheduler.json"),
        ]
        self.start("scheduler", args + (tls_args(certs, "127.0.0.1") if certs else []))
        return str(self.ready("scheduler")["address"])

    def daemon(
        self, host: str, scheduler: str, *extra: str, name: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a daemon of ``host`` (ready file ``<name>.json``)."""
        name = name or host
        args = [
            "daemon",
            "--host",
            host,
            "--scheduler",
            scheduler,
            "--socket",
            str(self.dir / f"{name}.sock"),
            "--ready-file",
            str(self.dir / f"{name}.json"),
            "--connect-timeout",
            "10",
            *extra,
        ]
        return self.start(name, args)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def push(server_socket: str, worker_socket: str, n: int) -> dict[str, Any]:
    """Run tests/ops/pushes.py: a server on one daemon, a worker pushing ``n`` updates on the other."""
    out = subprocess.run(
        [sys.executable, str(OPS / "pushes.py"), server_socket, worker_socket, str(n)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
