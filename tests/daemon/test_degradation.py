"""Graceful degradation: pushes keep their place while the scheduler is away (DESIGN §3).

In-process daemons against the test scheduler show the two ways back for a push the scheduler
no longer knows: announced again to a scheduler that is back in time, or sent directly after
``fallback_after`` seconds. Real processes (the scheduler service SIGKILLed and restarted on
the same address) show that pushes made during the outage are APPLIED, that sends are
scheduled again afterwards, and — from a model where every push adds to its own coordinate —
that nothing was applied twice.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import mlfabric
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon
from mlfabric.daemon.metrics import DaemonCollector
from mlfabric.proto.v1 import control_pb2
from tests.daemon.conftest import FakeScheduler
from tests.daemon.test_daemon_processes import Processes

UPDATE = {"w": np.ones((2, 3)), "b": np.ones(4, np.float32)}


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def pair(make_daemon: Any) -> Iterator[dict[str, Any]]:
    """Daemons "ps" (server ps0 serving in a thread) and "w0" (fallback after 0.5 s), a worker."""
    ps, w0 = make_daemon("ps"), make_daemon("w0", fallback_after=0.5)
    model = {"w": np.zeros((2, 3)), "b": np.zeros(4, np.float32)}
    server = mlfabric.register_as_server("job", "ps0", model, daemon=ps.config.socket_path)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w0", daemon=w0.config.socket_path, wait=5)
    yield {"ps": ps, "w0": w0, "server": server, "worker": worker}
    worker.close()
    server.stop()
    thread.join(5)
    server.close()


def test_waiting_push_is_sent_directly_when_the_scheduler_stays_away(
    pair: dict[str, Any], scheduler: FakeScheduler
) -> None:
    worker, w0 = pair["worker"], pair["w0"]
    scheduler.hold = True
    handle = worker.push("ps0", UPDATE)
    wait_until(lambda: scheduler.ready)
    scheduler.stop()
    result = handle.wait(10)
    assert result.applied and result.version == 1 and pair["server"].version == 1
    assert w0.worker.fallback.direct_sends == 1
    new = worker.push("ps0", UPDATE).wait(10)  # while falling back: sent at once
    assert new.applied and new.version == 2 and w0.worker.fallback.direct_sends == 2


def test_waiting_push_is_announced_again_to_a_scheduler_back_in_time(
    pair: dict[str, Any], scheduler: FakeScheduler
) -> None:
    worker, w0 = pair["worker"], pair["w0"]
    w0.worker.fallback.after = 30.0  # the scheduler is back long before
    scheduler.hold = True
    handle = worker.push("ps0", UPDATE)
    wait_until(lambda: scheduler.ready)
    update_id = scheduler.ready[-1].update_id
    port = int(scheduler.address.rsplit(":", 1)[1])
    scheduler.stop()
    kept = worker.push("ps0", UPDATE)  # made while it is away: kept, not DROPPED
    fresh = FakeScheduler()
    fresh.start(port)
    try:
        results = [handle.wait(15), kept.wait(15)]
        assert [r.status for r in results] == [mlfabric.APPLIED] * 2
        assert sorted(r.version for r in results) == [1, 2] and pair["server"].version == 2
        announced = [r.update_id for r in fresh.ready]
        assert update_id in announced and len(announced) == len(set(announced)) == 2
        assert w0.worker.fallback.direct_sends == 0
    finally:
        fresh.stop()


def test_push_made_while_the_worker_re_registers_is_kept_and_announced_once_registered(
    pair: dict[str, Any], scheduler: FakeScheduler
) -> None:
    """The worker's daemon is back before the server's: its push waits instead of being DROPPED."""
    worker, w0 = pair["worker"], pair["w0"]
    w0.worker.fallback.after = 30.0
    port = int(scheduler.address.rsplit(":", 1)[1])
    scheduler.stop()
    fresh = FakeScheduler()
    original = fresh._on_message
    servers_allowed: list[bool] = []

    def on_message(host: str, address: str, m: Any) -> None:
        r = m.register_role if m.WhichOneof("kind") == "register_role" else None
        if r is not None and r.role == control_pb2.ROLE_SERVER and not servers_allowed:
            return  # the server's daemon is "not back yet"
        original(host, address, m)

    fresh._on_message = on_message  # type: ignore[method-assign]
    fresh.start(port)
    try:
        wait_until(lambda: any(h == "w0" for h, _, _ in fresh.registered), timeout=15)
        handle = worker.push("ps0", UPDATE)  # refused "unknown job" meanwhile: kept
        wait_until(lambda: w0.worker.fallback.unannounced() == 1)
        assert not fresh.ready
        servers_allowed.append(True)
        pair["ps"]._on_connected(None)  # the server's daemon comes back and re-registers
        result = handle.wait(15)
        assert result.applied and result.version == 1
        assert [r.update_id for r in fresh.ready] == [result.update_id]
        assert w0.worker.fallback.direct_sends == 0
    finally:
        fresh.stop()


def test_without_fallback_a_push_made_while_the_scheduler_is_away_is_dropped(
    pair: dict[str, Any], scheduler: FakeScheduler
) -> None:
    pair["w0"].worker.fallback.after = None
    scheduler.stop()
    wait_until(lambda: not pair["w0"]._control.connected.is_set())
    result = pair["worker"].push("ps0", UPDATE).wait(10)
    assert result.status == mlfabric.DROPPED and "not connected" in result.reason


def test_metrics_show_the_fallback_and_the_budgets(scheduler: FakeScheduler, sockdir: str) -> None:
    config = DaemonConfig(
        host="w9",
        scheduler=scheduler.address,
        socket_path=os.path.join(sockdir, "w9.sock"),
        fallback_after=0.2,
    )
    daemon = Daemon(config)
    registry = CollectorRegistry()
    registry.register(DaemonCollector(daemon.stats))  # what --metrics-port serves
    daemon.start(timeout=10)
    try:
        get, host = registry.get_sample_value, {"host": "w9"}
        assert get("mlfabric_daemon_fallback_active", host) == 0
        assert get("mlfabric_daemon_inflight_bytes", {**host, "budget": "receive"}) == 0
        assert get("mlfabric_daemon_unannounced_pushes", host) == 0
        scheduler.stop()
        wait_until(lambda: get("mlfabric_daemon_fallback_active", host) == 1)
    finally:
        daemon.stop()


# ---------------------------------------------------------------- real processes


def _daemon(procs: Processes, host: str, scheduler: str, sockdir: str) -> dict[str, Any]:
    return procs.start(
        host,
        "mlfabric.daemon.cli",
        "--host",
        host,
        "--scheduler",
        scheduler,
        "--socket",
        os.path.join(sockdir, f"{host}.sock"),
        "--fallback-after",
        "1",
    )


def _scheduler(procs: Processes, name: str, listen: str) -> dict[str, Any]:
    args = ("--listen", listen, "--star", "3", "--policy", "fair", "--metrics-port", "0")
    return procs.start(name, "mlfabric.scheduler.service.cli", *args)


def _applied_by_scheduler(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r'^mlfabric_updates_resolved_total\{outcome="applied"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_scheduler_killed_and_restarted_pushes_applied_exactly_once(tmp_path: Path, sockdir: str) -> None:
    procs = Processes(tmp_path)
    try:
        _run_outage(procs, sockdir)
    finally:
        procs.reap()


def _run_outage(procs: Processes, sockdir: str) -> None:
    sched = _scheduler(procs, "scheduler", "127.0.0.1:0")
    for host in ("h0", "h1", "h2"):
        _daemon(procs, host, sched["address"], sockdir)
    per_worker, size = 60, 256
    server = mlfabric.register_as_server(
        "job", "ps0", {"w": np.zeros(size)}, daemon=os.path.join(sockdir, "h0.sock")
    )
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    workers = {
        h: mlfabric.register_as_worker(
            "job", name=f"w{h}", daemon=os.path.join(sockdir, f"{h}.sock"), wait=10
        )
        for h in ("h1", "h2")
    }
    # push i of worker k adds to coordinate k * 128 + i alone: the model tells which were applied
    pushed: dict[int, tuple[float, Any]] = {}
    lock = threading.Lock()

    def push(k: int, h: str, i: int) -> None:
        vec = np.zeros(size)
        vec[k * 128 + i] = 1.0
        handle = workers[h].push("ps0", {"w": vec})
        with lock:
            pushed[k * 128 + i] = (time.monotonic(), handle)

    for k, h in enumerate(workers):  # scheduled, before the outage
        for i in range(5):
            push(k, h, i)
    assert all(h.wait(20).applied for _, h in pushed.values())

    def pusher(k: int, h: str) -> None:
        for i in range(5, per_worker):
            push(k, h, i)
            time.sleep(0.08)

    threads = [threading.Thread(target=pusher, args=(k, h)) for k, h in enumerate(workers)]
    for t in threads:
        t.start()
    time.sleep(0.8)
    procs.kill("scheduler")
    killed = time.monotonic()
    time.sleep(2.5)  # longer than --fallback-after: the daemons send directly
    restarted = time.monotonic()
    fresh = _scheduler(procs, "scheduler-again", sched["address"])
    for t in threads:
        t.join(30)
    results = {i: (t, h.wait(30)) for i, (t, h) in pushed.items()}
    during = [r for t, r in results.values() if killed < t < restarted]
    assert len(during) >= 20
    assert all(r.applied for r in during), [r for r in during if not r.applied][:3]
    before = [r for t, r in results.values() if t <= killed]
    assert all(r.applied for r in before), [r for r in before if not r.applied][:3]
    # the worker daemons fell back, and came back to scheduled sends
    for h in workers:
        log = procs.workdir / f"{h}.log"
        assert "directly to their servers" in log.read_text(errors="replace")
        wait_until(lambda log=log: "scheduler back" in log.read_text(errors="replace"), timeout=20)
    # after the restart: sends are scheduled again (the new scheduler counts their outcomes)
    after: list[Any] = []
    deadline = time.monotonic() + 20
    while _applied_by_scheduler(fresh["metrics_port"]) < 10 and time.monotonic() < deadline:
        for k, h in enumerate(workers):
            i = per_worker + len(after) // 2
            push(k, h, i)
            after.append(pushed[k * 128 + i][1].wait(20))
    assert _applied_by_scheduler(fresh["metrics_port"]) >= 10
    # exactly once: every APPLIED push's coordinate moved once, every other push's not at all
    for w in workers.values():
        w.close()
    server.stop()
    serving.join(5)
    model = np.asarray(server.model["w"]).copy()
    final = {i: h.wait(1) for i, (_, h) in pushed.items()}
    for i, r in final.items():
        expected = -1.0 if r.applied else 0.0
        assert r.status != mlfabric.UNKNOWN, r
        assert model[i] == expected, (i, r, model[i])
    untouched = np.delete(model, list(final))
    assert not untouched.any()
    server.close()


def test_a_daemon_that_stops_itself_does_not_warn_that_the_scheduler_was_lost(
    scheduler: FakeScheduler, sockdir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 27: every clean stop logged "scheduler lost: 0 pushes kept; sending directly ..."."""
    config = DaemonConfig(
        host="h0", scheduler=scheduler.address, socket_path=os.path.join(sockdir, "h0.sock")
    )
    daemon = Daemon(config)
    daemon.start(timeout=10)
    with caplog.at_level("WARNING"):
        daemon.stop()
    assert not [r for r in caplog.records if "scheduler lost" in r.getMessage()], caplog.text
