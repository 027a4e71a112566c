"""The ring all-reduce on loopback: exact sums for 2, 3 and 5 participants (odd sizes, float32
and float64), and the ring's routes (pure): every chunk summed once per participant, delivered
to all.

The cluster declares 100 Mbit/s NICs without enforcing them: the scheduler plans on the
declared graph, where a ring beats every tree for these worlds, and the data moves at loopback
speed.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.cluster import LocalCluster
from mlfabric.daemon.roles.allreduce.routes import routing
from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.tensors import Layout


def contribution(rank: int, step: int) -> dict[str, np.ndarray]:
    """Integer-valued tensors (exact sums) of element counts no world size here divides."""
    rng = np.random.default_rng(7919 * step + rank)
    return {
        "a": rng.integers(-1000, 1000, size=(7, 13)).astype(np.float64),
        "b": rng.integers(-64, 64, size=(1_000_003,)).astype(np.float32),
        "c": rng.integers(-1000, 1000, size=(3,)).astype(np.float64),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "hosts", [["h0", "h1"], ["h0", "h1", "h2"], ["h0", "h1", "h2", "h3", "h0"]], ids=["2", "3", "5"]
)
def test_ring_sums_exactly_for_odd_sizes_and_both_float_widths(make_cluster: Any, hosts: list[str]) -> None:
    cluster: LocalCluster = make_cluster(mbps=100, enforce=False)
    n, steps = len(hosts), 2

    def rank_main(rank: int) -> list[tuple[dict[str, Any], str]]:
        with mlfabric.join_allreduce(
            "job-ring", world_size=n, participant=f"r{rank}", daemon=cluster.socket(hosts[rank])
        ) as group:
            out = []
            for s in range(steps):
                h = group.allreduce_async(contribution(rank, s), timeout=60)
                out.append((h.wait(), h.plan))
            return out

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(rank_main, range(n)))
    for s in range(steps):
        expected = {k: np.sum([contribution(r, s)[k] for r in range(n)], axis=0) for k in ("a", "b", "c")}
        for rank, per_step in enumerate(results):
            got, plan = per_step[s]
            assert plan.startswith(f"ring of {n}:"), plan
            for k, v in expected.items():
                assert got[k].dtype == v.dtype and got[k].shape == v.shape, (rank, k)
                np.testing.assert_array_equal(got[k], v, err_msg=f"rank {rank} step {s} tensor {k}")


def _simulate(n: int, layouts: list[Layout], nbytes: int, chunk: int) -> None:
    """Run every participant's routes as messages: each chunk's sum must hold every participant
    exactly once at its root, and every participant must get every chunk's result once."""
    ring = [pb.AllreducePeer(participant=f"p{i}") for i in range(n)]
    r = {
        f"p{i}": routing(
            pb.AllreduceDirective(participant=f"p{i}", ring=ring, chunk_bytes=chunk, world_size=n),
            layouts,
            nbytes,
        )
        for i in range(n)
    }
    chunks = r["p0"].chunks
    assert all(x.chunks == chunks and x.segment_of == r["p0"].segment_of for x in r.values())
    assert [c.lo for c in chunks] == sorted(c.lo for c in chunks) and chunks[-1].hi == nbytes
    assert all(a.hi == b.lo for a, b in itertools.pairwise(chunks)) and chunks[0].lo == 0
    assert all(len(x.peers) <= 1 for x in r.values())  # each sends to one neighbour only
    for c in chunks:
        # reduce: from each leaf (no children), partial sums go parent to parent
        (leaf,) = [p for p, x in r.items() if not x.route(c.index).children]
        summed, at = [leaf], leaf
        while (parent := r[at].route(c.index).parent) is not None:
            assert r[parent.participant].route(c.index).children == (at,)
            summed.append(parent.participant)
            at = parent.participant
        assert sorted(summed) == sorted(r), (c.index, summed)  # every participant exactly once
        # broadcast: from the root along forward, each participant reached once
        got, frontier = {at}, [at]
        while frontier:
            q = frontier.pop()
            for f in r[q].route(c.index).forward:
                assert f.participant not in got and r[f.participant].route(c.index).source == q
                got.add(f.participant)
                frontier.append(f.participant)
        assert got == set(r)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("nbytes", "chunk"), [(8 * 1001, 1000), (8 * 3, 8), (8 * 1001, 1 << 20)])
def test_ring_routes_sum_each_participant_once_and_deliver_to_all(n: int, nbytes: int, chunk: int) -> None:
    _simulate(n, [Layout("x", "float64", (nbytes // 8,), 0, nbytes)], nbytes, chunk)


def test_ring_routes_cut_mixed_dtypes_on_element_boundaries() -> None:
    layouts = [Layout("a", "float64", (5,), 0, 40), Layout("b", "float32", (7,), 40, 28)]
    _simulate(3, layouts, 68, 12)
    ring = [pb.AllreducePeer(participant=p) for p in ("x", "y", "z")]
    r = routing(pb.AllreduceDirective(participant="x", ring=ring, chunk_bytes=12, world_size=3), layouts, 68)
    for c in r.chunks:
        for piece in c.layouts:  # every piece whole elements of its dtype
            assert piece.nbytes % (8 if piece.dtype == "float64" else 4) == 0


def test_a_ring_without_this_participant_or_of_the_wrong_size_is_refused() -> None:
    ring = [pb.AllreducePeer(participant=p) for p in ("a", "b")]
    layouts = [Layout("x", "float64", (4,), 0, 32)]
    with pytest.raises(ValueError, match="'c' exactly once"):
        routing(pb.AllreduceDirective(participant="c", ring=ring, chunk_bytes=8, world_size=2), layouts, 32)
    with pytest.raises(ValueError, match="ring of 2 participants for world size 3"):
        routing(pb.AllreduceDirective(participant="a", ring=ring, chunk_bytes=8, world_size=3), layouts, 32)
