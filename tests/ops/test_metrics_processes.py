"""The scheduler and daemons as processes started from config files: /metrics and SIGHUP."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

H1_UP = {"src": "h1", "dst": "sw"}


def test_both_endpoints_move_during_a_push(ops_cluster: Any) -> None:
    c = ops_cluster
    sched_port, h0_port, h1_port = (
        c.scheduler["metrics_port"],
        c.daemons["h0"]["metrics_port"],
        c.daemons["h1"]["metrics_port"],
    )
    s0, d0, w0 = c.scrape(sched_port), c.scrape(h0_port), c.scrape(h1_port)
    assert c.sample(s0, "mlfabric_daemons_connected") == 2
    assert c.sample(s0, "mlfabric_link_capacity_bytes_per_second", **H1_UP) == 1e9 / 8

    result = c.push("h0", "h1", 20)  # server on h0, worker on h1

    assert result == {"applied": 20, "dropped": 0, "reasons": []}
    s1, d1, w1 = c.scrape(sched_port), c.scrape(h0_port), c.scrape(h1_port)
    # the scheduler: outcomes, decisions, bytes over the worker's uplink, completion times
    assert (
        c.sample(s1, "mlfabric_updates_applied_total") - c.sample(s0, "mlfabric_updates_applied_total") == 20
    )
    assert c.sample(s1, "mlfabric_updates_resolved_total", outcome="applied") == 20
    assert c.sample(s1, "mlfabric_decision_seconds_count") > c.sample(s0, "mlfabric_decision_seconds_count")
    moved = c.sample(s1, "mlfabric_link_transferred_bytes_total", **H1_UP)
    assert moved >= 20 * 64 * 1024 * 4
    assert c.sample(s1, "mlfabric_link_scheduled_bytes_total", **H1_UP) >= 20 * 64 * 1024 * 4
    assert c.sample(s1, "mlfabric_link_scheduled_bytes_total", src="sw", dst="h0") >= 20 * 64 * 1024 * 4
    assert c.sample(s1, "mlfabric_transfer_duration_seconds_count") == 20
    assert c.sample(s1, "mlfabric_update_delay_versions_count") == 20
    # the worker's daemon sent, the server's daemon received, both counted the verdicts
    assert c.sample(w1, "mlfabric_daemon_sent_bytes_total", host="h1", dst="h0") >= 20 * 64 * 1024 * 4
    assert c.sample(w1, "mlfabric_daemon_transfers_total", host="h1", result="ok") == 20
    assert c.sample(w1, "mlfabric_daemon_updates_resolved_total", host="h1", outcome="applied") == 20
    assert c.sample(d1, "mlfabric_daemon_received_bytes_total", host="h0", src="h1") >= 20 * 64 * 1024 * 4
    assert c.sample(d1, "mlfabric_daemon_received_frames_total", host="h0") >= 20
    assert c.sample(d0, "mlfabric_daemon_received_frames_total", host="h0") == 0
    assert c.sample(w0, "mlfabric_daemon_sent_bytes_total", host="h1", dst="h0") == 0


def test_sighup_swaps_the_topology_and_keeps_the_sessions(ops_cluster: Any, tmp_path: Path) -> None:
    c = ops_cluster
    port, pid = c.scheduler["metrics_port"], c.scheduler["pid"]
    assert c.push("h0", "h1", 3)["applied"] == 3
    (tmp_path / "topology.toml").write_text(c.topology(2))
    conf = tmp_path / "scheduler.toml"
    conf.write_text(conf.read_text().replace('policy = "stf"', 'policy = "fair"') + 'log_level = "DEBUG"\n')
    assert " DEBUG " not in c.log("scheduler")

    os.kill(pid, signal.SIGHUP)

    deadline = time.monotonic() + 20
    while c.sample(c.scrape(port), "mlfabric_link_capacity_bytes_per_second", **H1_UP) != 2e9 / 8:
        assert time.monotonic() < deadline, c.log("scheduler")
        time.sleep(0.1)
    after = c.scrape(port)
    assert c.sample(after, "mlfabric_daemons_connected") == 2  # no session dropped
    assert c.procs["h0"].poll() is None and c.procs["h1"].poll() is None
    assert c.push("h0", "h1", 3)["applied"] == 3
    assert "daemon of host h1 disconnected" not in c.log("scheduler")
    log = c.log("scheduler")
    assert "reload: changed keys need a restart to take effect: policy" in log
    assert " DEBUG " in log  # the new log level took effect


def test_a_reload_without_a_connected_host_is_refused(ops_cluster: Any, tmp_path: Path) -> None:
    c = ops_cluster
    (tmp_path / "topology.toml").write_text(c.topology(5, hosts=("h0", "h2")))  # h1's daemon is connected

    os.kill(c.scheduler["pid"], signal.SIGHUP)

    deadline = time.monotonic() + 20
    while "reload failed" not in c.log("scheduler"):
        assert time.monotonic() < deadline, c.log("scheduler")
        time.sleep(0.1)
    assert "connected daemons: h1" in c.log("scheduler")
    samples = c.scrape(c.scheduler["metrics_port"])
    assert c.sample(samples, "mlfabric_link_capacity_bytes_per_second", **H1_UP) == 1e9 / 8
    assert c.push("h0", "h1", 2)["applied"] == 2


def test_daemon_sighup_applies_the_log_level_and_names_restart_keys(ops_cluster: Any, tmp_path: Path) -> None:
    c = ops_cluster
    conf = tmp_path / "h1.toml"
    conf.write_text(conf.read_text() + 'log_level = "DEBUG"\nsend_attempts = 7\n')

    os.kill(c.daemons["h1"]["pid"], signal.SIGHUP)

    deadline = time.monotonic() + 20
    while "need a restart" not in c.log("h1"):
        assert time.monotonic() < deadline, c.log("h1")
        time.sleep(0.1)
    assert "send_attempts" in c.log("h1")
    assert c.push("h0", "h1", 2)["applied"] == 2
    assert "log level now DEBUG" in c.log("h1")


def test_stop_is_clean(ops_cluster: Any) -> None:
    assert ops_cluster.stop() == {"scheduler": 0, "h0": 0, "h1": 0}
