"""torchrun launches 1 server + 3 workers of the digits example against a real mlfabric cluster."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from mlfabric.cluster import LocalCluster

STEPS = 10


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_torchrun_trains_and_every_push_is_applied_exactly_once(
    cluster: LocalCluster, tmp_path: Path, mode: str
) -> None:
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nnodes", "1", "--nproc-per-node", "4",
        "-m", "mlfabric.examples.torchrun_digits", "--steps", str(STEPS), "--mode", mode, "--out", str(out),
    ]  # fmt: skip
    cluster.wait(cluster.spawn("h0", argv, name=f"torchrun-{mode}"), timeout=240)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    server, workers = ranks[0], ranks[1:]
    assert server["role"] == "server" and [w["role"] for w in workers] == ["worker"] * 3
    groups = len(server["servers"])
    assert groups == 4  # one server per tensor of the MLP (--group-bytes 0)
    for w in workers:
        assert w["steps"] == STEPS and w["pushed"] == w["applied"] == STEPS * groups and w["dropped"] == 0
    pushed = [i for w in workers for i in w["update_ids"]]
    assert len(pushed) == len(set(pushed)) == 3 * STEPS * groups
    # exactly once: the servers applied each pushed update once, and nothing else
    assert sorted(server["update_ids"]) == sorted(pushed)
    assert server["worker_updates"] == len(pushed) and server["dropped"] == 0
    # applies: one per update (async), one per round of the 3 workers (sync)
    assert server["applied"] == (len(pushed) if mode == "async" else STEPS * groups)
    assert server["accuracy"] > 0.2  # trained (chance: 0.1)
