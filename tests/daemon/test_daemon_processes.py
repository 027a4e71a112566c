"""Real processes on loopback: the scheduler service, ``mlfabric daemon`` processes, and pushes.

The training processes (a server serving in a thread, a worker) are this test process, talking
to the daemons through the public API. Every process started here is reaped by the fixture.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric

pytestmark = pytest.mark.slow

# Run one subcommand module the way `mlfabric <cmd>` does (configure + run), without building
# the parser of every other subcommand.
RUNNER = (
    "import argparse, importlib, logging, sys\n"
    "mod = importlib.import_module(sys.argv[1])\n"
    "parser = argparse.ArgumentParser()\n"
    "mod.configure(parser)\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "sys.exit(mod.run(parser.parse_args(sys.argv[2:])))\n"
)

TOPOLOGY = """
hosts = ["h0", "h1", "h2"]
switches = ["sw"]

[[links]]
a = "h0"
b = "sw"
mbps = 16

[[links]]
a = "h1"
b = "sw"
mbps = 1000

[[links]]
a = "h2"
b = "sw"
mbps = 1000
"""


class Processes:
    """Starts subcommand processes, waits for their ready files, reaps them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, module: str, *args: str, timeout: float = 30.0) -> dict[str, Any]:
        ready = self.workdir / f"{name}.json"
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-c", RUNNER, module, *args, "--ready-file", str(ready)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs[name] = proc
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}: {self.log(name)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not ready within {timeout} s: {self.log(name)}")
            time.sleep(0.05)
        return dict(json.loads(ready.read_text()))

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self, name: str, timeout: float = 10.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def reap(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout=5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    yield group
    group.reap()


@pytest.fixture
def cluster(procs: Processes, sockdir: str, tmp_path: Path) -> dict[str, Any]:
    """The real scheduler (fair) and daemons h0 (server's host, 16 Mbit/s NIC enforced) and h1."""
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    sched = procs.start(
        "scheduler",
        "mlfabric.scheduler.service.cli",
        "--listen",
        "127.0.0.1:0",
        "--topology",
        str(topology),
        "--policy",
        "fair",
    )
    daemons = {}
    for host in ("h0", "h1"):
        daemons[host] = procs.start(
            host,
            "mlfabric.daemon.cli",
            "--host",
            host,
            "--scheduler",
            sched["address"],
            "--socket",
            os.path.join(sockdir, f"{host}.sock"),
            "--data-listen",
            "127.0.0.1:0",
            "--topology",
            str(topology),
            "--enforce-nic-rates",
        )
    return {"scheduler": sched, "daemons": daemons}


def _serve(server: Any, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            server.serve()
        except mlfabric.MlfabricError as exc:  # the daemon went away under it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_pushes_through_daemon_processes_exact_model(cluster: dict[str, Any], procs: Processes) -> None:
    h0, h1 = cluster["daemons"]["h0"], cluster["daemons"]["h1"]
    assert h0["pid"] != h1["pid"] and h0["data_address"].startswith("127.0.0.1:")
    rng = np.random.default_rng(7)
    initial = {"w": rng.integers(-50, 50, size=(8, 5)).astype(np.float64), "b": np.zeros(3)}
    server = mlfabric.register_as_server(
        "job",
        "ps0",
        {k: v.copy() for k, v in initial.items()},
        mlfabric.Params(tau_max=2),
        daemon=h0["socket"],
    )
    errors: list[BaseException] = []
    thread = _serve(server, errors)
    worker = mlfabric.register_as_worker("job", name="w1", daemon=h1["socket"], wait=10)
    applied_sum = {k: np.zeros_like(v) for k, v in initial.items()}
    results = []
    for i in range(30):
        update = {"w": rng.integers(-3, 4, size=(8, 5)).astype(np.float64), "b": np.full(3, float(i))}
        base = max(0, i // 2)  # alternately fresh and stale base versions
        result = worker.push("ps0", update, base_version=base).wait(30)
        results.append(result)
        if result.applied:
            for k in update:
                applied_sum[k] += update[k]
        else:
            assert result.reason
    version, model = worker.get("ps0")
    applied = [r for r in results if r.applied]
    assert applied and len(applied) < len(results)  # some stale pushes were dropped
    assert version == len(applied) == server.version
    assert all(r.delay <= 2 for r in applied)
    for k in initial:
        np.testing.assert_array_equal(model[k], initial[k] - applied_sum[k])
    worker.close()
    server.stop()
    thread.join(5)
    server.close()
    assert not errors
    for name in ("h1", "h0", "scheduler"):
        assert procs.stop(name) == 0, procs.log(name)


def test_peer_daemon_killed_mid_transfer_resolves_unknown_or_dropped(
    cluster: dict[str, Any], procs: Processes
) -> None:
    h0, h1 = cluster["daemons"]["h0"], cluster["daemons"]["h1"]
    # 4 MiB through h0's 16 Mbit/s ingress takes about 2 s: plenty of time to kill h0 mid-transfer.
    shape = (1024, 1024)
    server = mlfabric.register_as_server(
        "job", "ps0", {"w": np.zeros(shape, np.float32)}, daemon=h0["socket"]
    )
    errors: list[BaseException] = []
    thread = _serve(server, errors)
    worker = mlfabric.register_as_worker("job", daemon=h1["socket"], wait=10)
    handle = worker.push("ps0", {"w": np.ones(shape, np.float32)})
    time.sleep(0.7)
    assert not handle.done()
    procs.kill("h0")
    started = time.monotonic()
    result = handle.wait(20)
    assert time.monotonic() - started < 15
    # once bytes of the frame left, the worker's daemon cannot know whether the server's
    # daemon took it all: it says UNKNOWN (never a false DROPPED) and does not resend
    assert result.status in (mlfabric.UNKNOWN, mlfabric.DROPPED), result
    assert result.reason
    assert server.version == 0
    thread.join(5)
    assert errors  # the server process learned that its daemon is gone
    server.close()
    # the worker's daemon is still healthy
    with pytest.raises(mlfabric.MlfabricError, match="ps9"):
        worker.push("ps9", {"w": np.ones(shape, np.float32)}).wait(5)
    worker.close()
    assert procs.stop("h1") == 0, procs.log("h1")


def test_daemon_without_scheduler_fails_with_the_reason(procs: Processes, sockdir: str) -> None:
    with pytest.raises(AssertionError, match="exited with 1"):
        procs.start(
            "lonely",
            "mlfabric.daemon.cli",
            "--host",
            "h0",
            "--scheduler",
            "127.0.0.1:1",
            "--socket",
            os.path.join(sockdir, "lonely.sock"),
            "--connect-timeout",
            "1",
        )
    assert "127.0.0.1:1" in procs.log("lonely")


def test_daemon_refused_by_the_scheduler_exits_at_once_naming_why(procs: Processes, sockdir: str) -> None:
    sched = procs.start(
        "scheduler", "mlfabric.scheduler.service.cli", "--listen", "127.0.0.1:0", "--star", "2"
    )
    started = time.monotonic()
    with pytest.raises(AssertionError, match="exited with 1"):
        procs.start(
            "stranger",
            "mlfabric.daemon.cli",
            "--host",
            "not-in-graph",
            "--scheduler",
            sched["address"],
            "--socket",
            os.path.join(sockdir, "stranger.sock"),
        )
    assert time.monotonic() - started < 15  # not the 30 s connect timeout
    assert "not-in-graph" in procs.log("stranger") and "INVALID_ARGUMENT" in procs.log("stranger")
