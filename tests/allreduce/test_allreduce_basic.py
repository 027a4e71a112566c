"""All-reduce on loopback: real scheduler, real daemons, 2-4 participants, exact integer sums."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.cluster import LocalCluster


def contribution(rank: int, step: int) -> dict[str, np.ndarray]:
    """Integer-valued float64 tensors (the sum is exact), different per rank and step."""
    rng = np.random.default_rng(1000 * step + rank)
    return {
        "w": rng.integers(-1000, 1000, size=(37, 11)).astype(np.float64),
        "b": rng.integers(-1000, 1000, size=(5,)).astype(np.float64),
        "h": rng.integers(-8, 8, size=(300_001,)).astype(np.float32),
    }


def run_ranks(cluster: LocalCluster, hosts: list[str], steps: int, **kw: Any) -> list[list[dict[str, Any]]]:
    n = len(hosts)

    def rank_main(rank: int) -> list[dict[str, Any]]:
        with mlfabric.join_allreduce(
            "job-ar", world_size=n, participant=f"r{rank}", daemon=cluster.socket(hosts[rank])
        ) as group:
            return [group.allreduce(contribution(rank, s), timeout=30, **kw) for s in range(steps)]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(rank_main, range(n)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "hosts", [["h0", "h1"], ["h0", "h1", "h2"], ["h0", "h1", "h2", "h3"], ["h0", "h0", "h1"]]
)
def test_sum_is_exact_at_every_participant(cluster: LocalCluster, hosts: list[str]) -> None:
    steps = 3
    results = run_ranks(cluster, hosts, steps)
    for s in range(steps):
        expected = {
            k: np.sum([contribution(r, s)[k] for r in range(len(hosts))], axis=0) for k in ("w", "b", "h")
        }
        for rank, per_step in enumerate(results):
            got = per_step[s]
            assert sorted(got) == ["b", "h", "w"]
            for k, v in expected.items():
                assert got[k].dtype == v.dtype and got[k].shape == v.shape, (rank, k)
                np.testing.assert_array_equal(got[k], v, err_msg=f"rank {rank} step {s} tensor {k}")
