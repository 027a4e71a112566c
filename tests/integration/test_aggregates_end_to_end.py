"""Exactly once through aggregates, end to end on loopback (paper §5, Fig. 6).

A scheduler running ``stf+agg``, daemons for the server's host ``ps``, two worker hosts and
the aggregator hop ``x`` (the only daemon that may aggregate; the server's link is 100x
slower than the others, so the policy sums updates at ``x``), a server and 4 workers pushing
the integration test's integer-valued float64 updates, asynchronous and synchronous. Every
push resolves; the final model equals the initial one minus exactly the APPLIED members;
the server applied aggregates; no member is applied twice. In the ``kill`` runs the
aggregator's daemon is SIGKILLed while the workers push: its members are planned again
and sent directly, still exactly once.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlfabric.cluster import LocalCluster
from tests.integration.jobs import applied_pushes, finish, read_outcome, spawn_workers, wait_for

HERE = Path(__file__).resolve().parent
ROLES = HERE / "agg_roles.py"
TAU_MAX = 30
WORKERS = [("a", 0), ("a", 1), ("b", 2), ("b", 3)]
PUSHES_PER_WORKER = 40

TOPOLOGY = """
hosts = ["ps", "a", "b", "x"]
switches = ["sw"]
[[links]]
a = "ps"
b = "sw"
mbps = 10
[[links]]
a = "a"
b = "sw"
mbps = 1000
[[links]]
a = "b"
b = "sw"
mbps = 1000
[[links]]
a = "x"
b = "sw"
mbps = 1000
"""


class AggregatorCluster(LocalCluster):
    """Only host ``x``'s daemon may aggregate; daemons log their transfer reports; rounds time out in 5 s."""

    def _daemon_args(self, host: str) -> list[str]:
        args = ["--report-file", str(self.workdir / "reports" / f"{host}.jsonl"), "--round-timeout", "5"]
        return [*super()._daemon_args(host), *args, *(() if host == "x" else ("--no-aggregator",))]


def _member_at_x(cluster: LocalCluster, proc: object, timeout: float) -> None:
    """Wait until a worker host's daemon reports a member sent to (and taken by) ``x``."""
    deadline = time.monotonic() + timeout
    while True:
        for host in ("a", "b"):
            path = cluster.workdir / "reports" / f"{host}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            if any(json.loads(line)["dst_host"] == "x" for line in lines if line.endswith("}")):
                return
        assert proc.popen.poll() is None, proc.log_tail()  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "no member reached x"
        time.sleep(0.005)


def _roles_module():  # the same update generator the workers used
    spec = importlib.util.spec_from_file_location("itest_roles", HERE / "roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("sync", [0, 4], ids=["async", "sync"])
@pytest.mark.parametrize("kill", [False, True], ids=["", "kill-aggregator"])
def test_pushes_through_aggregates_resolve_exactly_once(sync: int, kill: bool, tmp_path: Path) -> None:
    roles = _roles_module()
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "out"
    out.mkdir()
    extra = ["--aggregate-timeout", "10", *(["--aggregate-plan", "sync"] if sync else [])]
    cluster = AggregatorCluster(
        topology, policy="stf+agg", workdir=tmp_path / "run", extra_scheduler_args=extra
    )
    try:
        cluster.start()
        argv = [sys.executable, str(ROLES), "server", str(out), str(TAU_MAX), str(sync)]
        server = cluster.spawn("ps", argv, name="server")
        wait_for(out / "server.ready", server, 60)
        workers = spawn_workers(
            cluster, [sys.executable, str(ROLES), "worker"], out, WORKERS, PUSHES_PER_WORKER
        )
        if kill:
            _member_at_x(cluster, server, 60)
            aggregator = next(p for p in cluster.processes() if p.name == "daemon-x")
            aggregator.popen.send_signal(signal.SIGKILL)
            aggregator.popen.wait(10)
        finish(server, workers)
    finally:
        cluster.stop()

    results, served, members = read_outcome(out, WORKERS, PUSHES_PER_WORKER)

    if not sync and not kill:
        assert any(a["update_id"].startswith("agg:") for a in served["applied"]), "no aggregate applied"
    expected = roles.initial_model()
    for rank, p in applied_pushes(results, members, TAU_MAX):
        for k, v in roles.update_for(rank, p["index"]).items():
            expected[k] -= v
    assert all(d <= TAU_MAX for a in served["applied"] for d in a["delays"])
    if kill:  # an aggregate was under way at x: its members were planned afresh
        log = (tmp_path / "run" / "logs" / "scheduler.log").read_text()
        assert "aggregator's daemon" in log and "disconnected" in log
    final = np.load(out / "final.npz")
    for k, v in expected.items():
        np.testing.assert_array_equal(final[k], v)
