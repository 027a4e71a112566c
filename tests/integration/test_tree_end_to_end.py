"""Exactly once through multi-level aggregation trees (``stf+tree``), end to end on loopback.

Two racks behind 40 Mbit/s uplinks, the server ``ps`` behind 10 Mbit/s: the workers' hosts
``a0``, ``a1`` (rack A) and ``b0``, ``b1`` (rack B) do not aggregate (``--no-aggregator``), each
rack has an aggregator host without workers, ``ax`` and ``bx``. ``stf+tree`` sums each rack at
its aggregator and forwards rack B's sum into the aggregate at ``ax`` (which also sums rack
A's), which goes to the server: two levels. A real scheduler, a real daemon
per host, a server and 4 workers pushing the integration test's integer-valued float64 updates.
Every push resolves; the final model equals the initial one minus exactly the APPLIED updates;
no worker update is applied twice; asynchronous and synchronous (rounds of 4). In the ``kill``
runs ``bx``'s daemon is SIGKILLed once it gathers an aggregate to be summed into another (the
scheduler logs the directive) and a member reached it: its members are planned afresh (the
parent aggregate goes on without its sum, or fails whole if it had summed it), still exactly
once. The scheduler decides over batches of 1-3 s, so both racks' updates are planned together;
in the ``sync-rounds`` runs it decides on every arrival (the default batching) and plans each
round as a whole at its first arrival (docs/rounds.md): trees form all the same.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlfabric.cluster import LocalCluster
from tests.integration.jobs import applied_pushes, finish, read_outcome, spawn_workers, wait_for
from tests.integration.test_aggregates_end_to_end import ROLES, _roles_module

TAU_MAX = 30
WORKERS = [("a0", 0), ("a1", 1), ("b0", 2), ("b1", 3)]
PUSHES_PER_WORKER = 30
NOT_AGGREGATORS = ("ps", "a0", "a1", "b0", "b1")
#: decisions over batches of 1-3 s: both racks' updates pending together, so trees form
SCHEDULER_ARGS = [
    "--aggregate-timeout",
    "10",
    "--batch-window-us",
    "1000000",
    "--batch-max-wait-us",
    "3000000",
]

TOPOLOGY = """
hosts = ["ps", "a0", "a1", "ax", "b0", "b1", "bx"]
switches = ["core", "ra", "rb"]
links = [
  {a = "ps", b = "core", mbps = 10},
  {a = "ra", b = "core", mbps = 40},
  {a = "rb", b = "core", mbps = 40},
  {a = "a0", b = "ra", mbps = 1000},
  {a = "a1", b = "ra", mbps = 1000},
  {a = "ax", b = "ra", mbps = 1000},
  {a = "b0", b = "rb", mbps = 1000},
  {a = "b1", b = "rb", mbps = 1000},
  {a = "bx", b = "rb", mbps = 1000},
]
"""


class TreeCluster(LocalCluster):
    """Daemons log their transfer reports; only ``ax`` and ``bx`` aggregate."""

    def _daemon_args(self, host: str) -> list[str]:
        args = ["--report-file", str(self.workdir / "reports" / f"{host}.jsonl"), "--round-timeout", "5"]
        return [
            *super()._daemon_args(host),
            *args,
            *(("--no-aggregator",) if host in NOT_AGGREGATORS else ()),
        ]


def _reports(cluster: LocalCluster, host: str) -> list[dict[str, object]]:
    path = cluster.workdir / "reports" / f"{host}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _nested_member_at_bx(cluster: LocalCluster, proc: object, timeout: float) -> None:
    """Wait until ``bx`` gathers an aggregate to be summed into another and a member reached it."""
    deadline = time.monotonic() + timeout
    log = cluster.workdir / "logs" / "scheduler.log"
    while not (
        any(r["dst_host"] == "bx" for h in ("b0", "b1") for r in _reports(cluster, h))
        and re.search(r"at host bx \(\d+ members\) to be summed into agg:", log.read_text())
    ):
        assert proc.popen.poll() is None, proc.log_tail()  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "bx gathered no aggregate of a two-level tree"
        time.sleep(0.005)


#: the default batching (a decision per arrival, 300 us quiet): a synchronous round is planned as
#: a whole at its first arrival, the members still to come expected (docs/rounds.md)
ROUND_ARGS = ["--aggregate-timeout", "10"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "scheduler_args", "kill"),
    [
        (0, SCHEDULER_ARGS, False),
        (4, SCHEDULER_ARGS, False),
        (4, ROUND_ARGS, False),
        (0, SCHEDULER_ARGS, True),
        (4, SCHEDULER_ARGS, True),
        # not (4, ROUND_ARGS, True): the kill waits for bx to gather an aggregate summed into
        # another, which a round's plan makes only when it finds it faster (a fresh-clone run
        # under load planned none within the minute the test waits)
    ],
    ids=["async", "sync", "sync-rounds", "kill-inner-aggregator-async", "kill-inner-aggregator-sync"],
)
def test_pushes_through_two_level_trees_resolve_exactly_once(
    sync: int, scheduler_args: list[str], kill: bool, tmp_path: Path
) -> None:
    roles = _roles_module()
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "out"
    out.mkdir()
    cluster = TreeCluster(
        topology, policy="stf+tree", workdir=tmp_path / "run", extra_scheduler_args=scheduler_args
    )
    nested: list[dict[str, object]] = []
    summed: list[dict[str, object]] = []
    try:
        cluster.start()
        argv = [sys.executable, str(ROLES), "server", str(out), str(TAU_MAX), str(sync)]
        server = cluster.spawn("ps", argv, name="server")
        wait_for(out / "server.ready", server, 60)
        workers = spawn_workers(
            cluster, [sys.executable, str(ROLES), "worker"], out, WORKERS, PUSHES_PER_WORKER
        )
        if kill:
            _nested_member_at_bx(cluster, server, 60)
            inner = next(p for p in cluster.processes() if p.name == "daemon-bx")
            inner.popen.send_signal(signal.SIGKILL)
            inner.popen.wait(10)
        finish(server, workers)
        # aggregates forwarded into another aggregate (not to the server): the tree's inner level
        summed = [
            r for h in ("ax", "bx") for r in _reports(cluster, h) if str(r["update_id"]).startswith("agg:")
        ]
        nested = [r for r in summed if r["dst_host"] != "ps"]
    finally:
        cluster.stop()

    results, served, members = read_outcome(out, WORKERS, PUSHES_PER_WORKER)

    if not kill and scheduler_args is SCHEDULER_ARGS:
        assert any(r["ok"] for r in nested), "no aggregate was summed into another aggregate"
    if scheduler_args is ROUND_ARGS:  # rounds planned as a whole: summed at the aggregators (one
        # level or two, whichever the plan found faster)
        assert any(r["ok"] for r in summed), "no aggregate was made at ax or bx"
    if not kill and not sync:  # (a synchronous server applies rounds, named round:...)
        racks = [{m[0] for m in a["members"]} for a in served["applied"] if a["update_id"].startswith("agg:")]
        assert {"a", "b"} in racks, "no aggregate applied held both racks' updates (two levels)"
    expected = roles.initial_model()
    for rank, p in applied_pushes(results, members, TAU_MAX):
        for k, v in roles.update_for(rank, p["index"]).items():
            expected[k] -= v
    if kill:  # bx was gathering an aggregate to be summed into another one when it died
        log = (tmp_path / "run" / "logs" / "scheduler.log").read_text()
        assert re.search(
            r"aggregate \S+ \(to be summed into agg:\S+\) failed \(the aggregator's daemon \(host 'bx'\)", log
        )
    final = np.load(out / "final.npz")
    for k, v in expected.items():
        np.testing.assert_array_equal(final[k], v)


F32_ROLES = Path(__file__).resolve().parent / "f32_roles.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "scheduler_args"), [(0, SCHEDULER_ARGS), (4, ROUND_ARGS)], ids=["async", "sync"]
)
def test_pipelined_trees_resolve_exactly_once(sync: int, scheduler_args: list[str], tmp_path: Path) -> None:
    """The same two-level trees with ``--pipelined-aggregates`` (float32 updates: summed as they land)."""
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "out"
    out.mkdir()
    cluster = TreeCluster(
        topology,
        policy="stf+tree",
        workdir=tmp_path / "run",
        extra_scheduler_args=[*scheduler_args, "--pipelined-aggregates"],
    )
    try:
        cluster.start()
        argv = [sys.executable, str(F32_ROLES), "server", str(out), str(TAU_MAX), str(sync)]
        server = cluster.spawn("ps", argv, name="server")
        wait_for(out / "server.ready", server, 60)
        workers = spawn_workers(
            cluster, [sys.executable, str(F32_ROLES), "worker"], out, WORKERS, PUSHES_PER_WORKER
        )
        finish(server, workers)
        summed = [
            r for h in ("ax", "bx") for r in _reports(cluster, h) if str(r["update_id"]).startswith("agg:")
        ]
    finally:
        cluster.stop()

    results, _served, members = read_outcome(out, WORKERS, PUSHES_PER_WORKER)
    assert "scheduler core failed" not in (tmp_path / "run" / "logs" / "scheduler.log").read_text()
    assert any(r["ok"] for r in summed), "no aggregate was made at ax or bx"
    roles = _roles_module()
    expected = {k: v.astype(np.float32) for k, v in roles.initial_model().items()}
    for rank, p in applied_pushes(results, members, TAU_MAX):
        for k, v in roles.update_for(rank, p["index"]).items():
            expected[k] -= v.astype(np.float32)
    final = np.load(out / "final.npz")
    for k, v in expected.items():
        np.testing.assert_array_equal(final[k], v)
