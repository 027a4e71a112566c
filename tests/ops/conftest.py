"""Helpers of the ops tests: a scheduler and daemons run from config files, and scrapes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent


def topology(gbps: float, hosts: tuple[str, ...] = ("h0", "h1", "h2")) -> str:
    """A star topology TOML: ``hosts`` around switch ``sw`` at ``gbps`` each way."""
    links = ", ".join(f'{{a = "{h}", b = "sw", gbps = {gbps}}}' for h in hosts)
    return f'hosts = {list(hosts)!r}\nswitches = ["sw"]\nlinks = [{links}]\n'.replace("'", '"')


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of ``http://127.0.0.1:port/metrics``: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample's value (0.0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> dict[str, Any]:
    """The JSON of a ready file, once it exists; fails when ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before writing {path}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no ready file {path} after {timeout} s")
        time.sleep(0.05)
    return dict(json.loads(path.read_text()))


@dataclass
class Cluster:
    """A scheduler and daemons started by :func:`ops_cluster` (processes of this test)."""

    dir: Path
    scheduler: dict[str, Any] = field(default_factory=dict)
    daemons: dict[str, dict[str, Any]] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, args: list[str]) -> dict[str, Any]:
        log = (self.dir / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "mlfabric", "--log-level", "INFO", *args], stderr=log)
        self.procs[name] = proc
        return wait_for_file(self.dir / f"{name}.json", proc)

    def push(self, server_host: str, worker_host: str, n: int) -> dict[str, Any]:
        out = subprocess.run(
            [
                sys.executable,
                str(HERE / "pushes.py"),
                self.daemons[server_host]["socket"],
                self.daemons[worker_host]["socket"],
                str(n),
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )
        return dict(json.loads(out.stdout.decode().splitlines()[-1]))

    scrape = staticmethod(scrape)
    sample = staticmethod(sample)
    topology = staticmethod(topology)

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text()

    def stop(self) -> dict[str, int]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


@pytest.fixture
def ops_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A scheduler (config file, inline-free topology file, metrics on port 0) and daemons h0, h1."""
    (tmp_path / "topology.toml").write_text(topology(1))
    (tmp_path / "scheduler.toml").write_text(
        'listen = "127.0.0.1:0"\npolicy = "stf"\nmetrics_port = 0\n'
        'topology = "topology.toml"\nready_file = "scheduler.json"\n'
    )
    cluster = Cluster(tmp_path)
    try:
        cluster.scheduler = cluster.start(
            "scheduler", ["scheduler", "--config", str(tmp_path / "scheduler.toml")]
        )
        for host in ("h0", "h1"):
            conf = tmp_path / f"{host}.toml"
            conf.write_text(
                f'host = "{host}"\nscheduler = "{cluster.scheduler["address"]}"\nmetrics_port = 0\n'
                f'socket = "{host}.sock"\nready_file = "{host}.json"\n'
            )
            cluster.daemons[host] = cluster.start(host, ["daemon", "--config", str(conf)])
        yield cluster
    finally:
        cluster.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
