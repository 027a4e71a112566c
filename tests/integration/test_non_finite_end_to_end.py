"""NaN/inf pushes end to end: refused by the receiving daemon, never applied (issue #16, 8).

The aggregation end-to-end cluster (``stf+agg``: scheduler, daemons ``ps``, ``a``, ``b`` and
the aggregator hop ``x``; the server's link 100x slower, so most updates are summed at ``x``)
with 4 workers pushing the integration test's integer-valued float64 updates, every third one
holding a NaN or an infinity. Each poisoned push resolves DROPPED naming its tensor and the
job option, refused by the aggregator (before summing it) or by the server's daemon (sent
directly); every other push is APPLIED or, if its aggregate's fate cannot be known, UNKNOWN;
the final model equals the initial one minus exactly the applied clean updates, and the
server process never saw a poisoned update.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.jobs import finish, spawn_workers, wait_for
from tests.integration.test_aggregates_end_to_end import (
    ROLES,
    TOPOLOGY,
    WORKERS,
    AggregatorCluster,
    _roles_module,
)

HERE = Path(__file__).resolve().parent
PUSHES = 24


def _nan_roles():  # the worker script's own update generator
    spec = importlib.util.spec_from_file_location("itest_nan_roles", HERE / "nan_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HERE))
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_non_finite_pushes_are_dropped_by_daemons_and_never_applied(tmp_path: Path) -> None:
    roles, nan_roles = _roles_module(), _nan_roles()
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "out"
    out.mkdir()
    cluster = AggregatorCluster(
        topology,
        policy="stf+agg",
        workdir=tmp_path / "run",
        extra_scheduler_args=["--aggregate-timeout", "10"],
    )
    try:
        cluster.start()
        server = cluster.spawn(
            "ps", [sys.executable, str(ROLES), "server", str(out), "1000", "0"], name="server"
        )
        wait_for(out / "server.ready", server, 60)
        workers = spawn_workers(cluster, [sys.executable, str(HERE / "nan_roles.py")], out, WORKERS, PUSHES)
        finish(server, workers)
    finally:
        cluster.stop()

    results = {rank: json.loads((out / f"worker{rank}.json").read_text()) for _, rank in WORKERS}
    served = json.loads((out / "server.json").read_text())
    members = [m for a in served["applied"] for m in a["members"]]
    assert len(members) == len(set(members)), "a member was applied twice"
    expected = roles.initial_model()
    refusers = set()
    for rank, pushes in results.items():
        assert len(pushes) == PUSHES
        for p in pushes:
            bad = nan_roles.poison(rank, p["index"])
            if bad is not None:
                assert p["status"] == "DROPPED", p
                assert f"tensor {bad!r} of {p['update_id']} holds non-finite values" in p["reason"], p
                assert "Params(refuse_non_finite=False) allows them" in p["reason"], p
                assert p["update_id"] not in members, "a poisoned update reached the server process"
                refusers.add("aggregator" if "aggregator 'x'" in p["reason"] else "server")
                continue
            assert p["status"] in ("APPLIED", "UNKNOWN", "DROPPED"), p
            applied = p["update_id"] in members
            assert applied == (p["status"] == "APPLIED") or p["status"] == "UNKNOWN", p
            if applied:
                for k, v in roles.update_for(rank, p["index"]).items():
                    expected[k] -= v
    assert "aggregator" in refusers, "no poisoned member reached the aggregator"
    final = np.load(out / "final.npz")
    for k, v in expected.items():
        np.testing.assert_array_equal(final[k], v)
