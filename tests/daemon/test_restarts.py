"""Restarts of real daemon processes: nothing answered from a stale verdict (DESIGN §3).

A restarted worker's daemon must not reuse update ids the server's daemon has verdicts for:
every push after the restart reaches the server process and moves the model.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric
from tests.daemon.test_daemon_processes import Processes

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(tmp_path: Path) -> Any:
    group = Processes(tmp_path)
    yield group
    group.reap()


def _daemon(procs: Processes, host: str, scheduler: str, sockdir: str, name: str = "") -> dict[str, Any]:
    return procs.start(
        name or host,
        "mlfabric.daemon.cli",
        "--host",
        host,
        "--scheduler",
        scheduler,
        "--socket",
        os.path.join(sockdir, f"{host}.sock"),
        "--data-listen",
        "127.0.0.1:0",
    )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_restarted_worker_daemon_pushes_reach_the_server(procs: Processes, sockdir: str, sig: int) -> None:
    sched = procs.start(
        "scheduler", "mlfabric.scheduler.service.cli", "--listen", "127.0.0.1:0", "--star", "2"
    )
    h0 = _daemon(procs, "h0", sched["address"], sockdir)
    _daemon(procs, "h1", sched["address"], sockdir)
    initial = np.zeros(4)
    server = mlfabric.register_as_server("job", "ps0", {"w": initial.copy()}, daemon=h0["socket"])
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        worker = mlfabric.register_as_worker(
            "job", name="w1", daemon=os.path.join(sockdir, "h1.sock"), wait=10
        )
        first = [worker.push("ps0", {"w": np.full(4, 1.0)}).wait(20) for _ in range(3)]
        assert [r.status for r in first] == [mlfabric.APPLIED] * 3
        worker.close()
        procs.procs["h1"].send_signal(sig)
        procs.procs["h1"].wait(10)
        _daemon(procs, "h1", sched["address"], sockdir, name="h1-again")
        worker = mlfabric.register_as_worker(
            "job", name="w1", daemon=os.path.join(sockdir, "h1.sock"), wait=10
        )
        second = [worker.push("ps0", {"w": np.full(4, 10.0)}).wait(20) for _ in range(3)]
        assert [r.status for r in second] == [mlfabric.APPLIED] * 3
        assert [r.version for r in second] == [4, 5, 6]  # applied now, not stale verdicts
        assert not {r.update_id for r in first} & {r.update_id for r in second}
        version, model = worker.get("ps0")
        assert version == 6 == server.version
        np.testing.assert_array_equal(model["w"], initial - 3 * 1.0 - 3 * 10.0)
        worker.close()
    finally:
        server.stop()
        thread.join(5)
        server.close()


@pytest.mark.parametrize(("apply_seconds", "outcomes"), [(0.5, {"APPLIED"}), (4.0, {"UNKNOWN", "APPLIED"})])
def test_sigterm_of_the_worker_daemon_resolves_the_push_in_flight(
    procs: Processes, sockdir: str, apply_seconds: float, outcomes: set[str]
) -> None:
    """SIGTERM of a worker's daemon while its push waits for the server's verdict (issue 27):
    the push resolves (APPLIED once its transfer is back within the daemon's drain, else
    UNKNOWN: it may have arrived), never ``MlfabricError(disconnected)``: the worker's
    connection closes only then."""
    sched = procs.start(
        "scheduler", "mlfabric.scheduler.service.cli", "--listen", "127.0.0.1:0", "--star", "2"
    )
    h0 = _daemon(procs, "h0", sched["address"], sockdir)
    _daemon(procs, "h1", sched["address"], sockdir)
    server = mlfabric.register_as_server("job", "ps0", {"w": np.zeros(4)}, daemon=h0["socket"])
    entered = threading.Event()

    @server.on_update
    def apply(update: dict[str, np.ndarray], meta: mlfabric.UpdateMeta) -> None:
        entered.set()
        time.sleep(apply_seconds)
        server.model["w"] -= update["w"]

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        worker = mlfabric.register_as_worker(
            "job", name="w1", daemon=os.path.join(sockdir, "h1.sock"), wait=10
        )
        handle = worker.push("ps0", {"w": np.ones(4)})
        assert entered.wait(20), "the push never reached the server process"
        procs.procs["h1"].send_signal(signal.SIGTERM)
        result = handle.wait(30)
        assert result.status in outcomes, result
        assert result.status == "APPLIED" or result.reason, result
        assert procs.procs["h1"].wait(20) == 0
        worker.close()
    finally:
        server.stop()
        thread.join(10)
        server.close()
    assert server.version == 1  # it was applied: never reported DROPPED
