"""All-reduce through a process group, end to end: a real scheduler and daemons plan it (a tree on
a heterogeneous star, the native collective on a uniform one), the ranks run it over gloo and
ask for the plan once; a mismatch on the first call is named at every rank by the scheduler."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mlfabric.cluster import LocalCluster

pytest.importorskip("torch")

PARTICIPANT = str(Path(__file__).with_name("group_participant.py"))
WORLD = 4


def run(cluster: LocalCluster, work: Path, job: str, *extra: str) -> list[dict]:
    store = work / f"store-{job}"
    procs = []
    for rank in range(WORLD):
        out = work / f"{job}-{rank}.json"
        argv = [sys.executable, PARTICIPANT, job, str(rank), str(WORLD), f"file://{store}", str(out), *extra]
        procs.append(
            cluster.spawn(f"h{rank}", argv, name=f"{job}-rank{rank}", env={"GLOO_SOCKET_IFNAME": "lo"})
        )
    for p in procs:
        cluster.wait(p, timeout=300)
    return [json.loads((work / f"{job}-{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.slow
def test_heterogeneous_star_runs_a_tree_asked_for_once(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster(rates={"h0": 1000, "h1": 250, "h2": 1000, "h3": 250})
    reports = run(cluster, tmp_path, "tree")
    for r in reports:
        assert r["errors"] == []
        assert r["plan_requests"] == 1  # four calls, one plan
        assert len(r["plans"]) == 4 and all(p.startswith("tree ") for p in r["plans"]), r["plans"]


@pytest.mark.slow
def test_uniform_star_runs_the_native_collective_and_names_a_mismatch(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster()
    reports = run(cluster, tmp_path, "native", "--mismatch")
    for r in reports:
        (call, code, message), *rest = r["errors"]
        assert rest == [] and call == 0 and code == "allreduce_mismatch"
        # both sides named: rank 1's shorter tensor and another rank's
        assert "rank 1 has 'grads': 'w' float32 (2097151,)" in message, message
        assert "float32 (2097152,)" in message
        assert len(r["plans"]) == 3 and all(p.startswith("native collective of 4") for p in r["plans"])
