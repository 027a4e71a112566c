"""End to end on loopback: scheduler, 3 daemons, a server and 4 workers, 200 pushes per policy.

Every push resolves; the final model equals the initial model minus the sum of exactly the
APPLIED updates (integer-valued float64, so the equality is exact); every DROPPED carries
a reason; no applied delay exceeds tau_max; no process is left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from mlfabric.cluster import LocalCluster
from tests.integration.jobs import finish, spawn_workers, wait_for

HERE = Path(__file__).resolve().parent
ROLES = HERE / "roles.py"
TAU_MAX = 2
WORKERS = [("a", 0), ("a", 1), ("b", 2), ("b", 3)]
PUSHES_PER_WORKER = 50

TOPOLOGY = """
hosts = ["ps", "a", "b"]
switches = ["sw"]
[[links]]
a = "ps"
b = "sw"
mbps = 1000
[[links]]
a = "a"
b = "sw"
mbps = 1000
[[links]]
a = "b"
b = "sw"
mbps = 1000
"""


def _roles_module():  # the same update generator the workers used
    spec = importlib.util.spec_from_file_location("itest_roles", ROLES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _our_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (this run's directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fair", "stf"])
def test_200_pushes_resolve_exactly(policy: str, tmp_path: Path) -> None:
    roles = _roles_module()
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "out"
    out.mkdir()
    cluster = LocalCluster(topology, policy=policy, workdir=tmp_path / "run")
    try:
        cluster.start()
        server = cluster.spawn(
            "ps", [sys.executable, str(ROLES), "server", str(out), str(TAU_MAX)], name="server"
        )
        wait_for(out / "server.ready", server, 60)
        workers = spawn_workers(
            cluster, [sys.executable, str(ROLES), "worker"], out, WORKERS, PUSHES_PER_WORKER
        )
        finish(server, workers)
        cluster.check_alive()
    finally:
        cluster.stop()

    results = {rank: json.loads((out / f"worker{rank}.json").read_text()) for _, rank in WORKERS}
    served = json.loads((out / "server.json").read_text())
    total = sum(len(r) for r in results.values())
    assert total == len(WORKERS) * PUSHES_PER_WORKER == 200

    applied_ids = [a["update_id"] for a in served["applied"]]
    assert len(applied_ids) == len(set(applied_ids)), "an update was applied twice"
    expected = roles.initial_model()
    worker_applied = set()
    for rank, pushes in results.items():
        for p in pushes:
            assert p["status"] in ("APPLIED", "DROPPED"), p
            if p["status"] == "DROPPED":
                assert p["reason"], f"DROPPED without a reason: {p}"
                continue
            assert p["delay"] <= TAU_MAX, p
            worker_applied.add(p["update_id"])
            for k, v in roles.update_for(rank, p["index"]).items():
                expected[k] -= v
    assert worker_applied == set(applied_ids), "workers' APPLIED differ from what the server applied"
    assert all(a["delay"] <= TAU_MAX for a in served["applied"])
    assert served["version"] == len(applied_ids)

    final = np.load(out / "final.npz")
    for k, v in expected.items():
        np.testing.assert_array_equal(final[k], v)
    assert not _our_processes(str(tmp_path)), "processes left behind"
