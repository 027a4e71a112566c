"""All-reduce bad input and failures: a named error at every participant, never a hang."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.cluster import LocalCluster
from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.allreduce import plan_allreduce

HERE = Path(__file__).resolve().parent
PARTICIPANT = HERE / "participant.py"


def outcome(group: Any, tensors: dict[str, Any], timeout: float = 30.0) -> Any:
    """The sum, or the MlfabricError the all-reduce raised."""
    try:
        return group.allreduce(tensors, timeout=timeout)
    except mlfabric.MlfabricError as exc:
        return exc


def run(
    cluster: LocalCluster, calls: list[tuple[str, int, dict[str, Any]]], timeout: float = 30.0
) -> list[Any]:
    """Each (host, world_size, tensors) is one participant ``r<i>``; their outcomes in order."""
    groups = [
        mlfabric.join_allreduce("job-e", world_size=w, participant=f"r{i}", daemon=cluster.socket(h))
        for i, (h, w, _) in enumerate(calls)
    ]
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [
                pool.submit(outcome, g, t, timeout) for g, (_, _, t) in zip(groups, calls, strict=True)
            ]
            return [f.result() for f in futures]
    finally:
        for g in groups:
            g.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("second", "words"),
    [
        ({"w": np.zeros(4)}, ["'w'", "(4,)", "(3,)"]),
        ({"w": np.zeros(3, np.float32)}, ["float32", "float64"]),
        ({"v": np.zeros(3)}, ["'v'", "'w'", "missing"]),
    ],
    ids=["shape", "dtype", "name"],
)
def test_mismatched_tensors_fail_every_participant_naming_both(
    cluster: LocalCluster, second: dict[str, Any], words: list[str]
) -> None:
    results = run(cluster, [("h0", 2, {"w": np.zeros(3)}), ("h1", 2, second)])
    for r in results:
        assert isinstance(r, mlfabric.MlfabricError), r
        assert r.code == "allreduce_mismatch"
        for w in words:
            assert w in str(r), (w, str(r))


@pytest.mark.slow
def test_world_size_disagreement_and_a_participant_announced_twice(cluster: LocalCluster) -> None:
    results = run(cluster, [("h0", 2, {"w": np.ones(3)}), ("h1", 3, {"w": np.ones(3)})])
    assert all(isinstance(r, mlfabric.MlfabricError) and r.code == "allreduce_mismatch" for r in results)
    assert "world size" in str(results[0])
    a = mlfabric.join_allreduce("job-d", world_size=3, participant="same", daemon=cluster.socket("h0"))
    b = mlfabric.join_allreduce("job-d", world_size=3, participant="same", daemon=cluster.socket("h1"))
    try:
        ha, hb = a.allreduce_async({"w": np.ones(2)}), b.allreduce_async({"w": np.ones(2)})
        for h in (ha, hb):
            with pytest.raises(mlfabric.MlfabricError, match="announced twice") as info:
                h.wait(timeout=30)
            assert info.value.code == "allreduce_mismatch"
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_after_a_failed_operation_the_next_one_sums_exactly(cluster: LocalCluster) -> None:
    groups = [
        mlfabric.join_allreduce("job-n", world_size=2, participant=f"r{i}", daemon=cluster.socket(h))
        for i, h in enumerate(["h0", "h1"])
    ]
    try:
        bad = [groups[0].allreduce_async({"w": np.ones(3)}), groups[1].allreduce_async({"w": np.ones(5)})]
        for h in bad:
            with pytest.raises(mlfabric.MlfabricError):
                h.wait(timeout=30)
        good = [g.allreduce_async({"w": np.arange(5.0) * (i + 1)}) for i, g in enumerate(groups)]
        for h in good:
            np.testing.assert_array_equal(h.wait(timeout=30)["w"], np.arange(5.0) * 3)
    finally:
        for g in groups:
            g.close()


@pytest.mark.slow
def test_a_participant_that_never_comes_times_out_at_the_deadline(cluster: LocalCluster) -> None:
    start = time.monotonic()
    results = run(cluster, [("h0", 3, {"w": np.ones(3)}), ("h1", 3, {"w": np.ones(3)})], timeout=2.0)
    took = time.monotonic() - start
    for r in results:
        assert isinstance(r, mlfabric.MlfabricError) and r.code == "allreduce_timeout", r
        assert "waiting for the other participants" in str(r) or "no result within" in str(r)
    assert took < 15, took


#: NIC rates (Mbit/s) under which the planner runs each algorithm for the kill tests' three
#: participants on h0, h1, h2 and 16 MB: uniform -> a ring; h2 at a quarter -> a tree (h2 a leaf).
KILL_RATES = {"ring": {}, "tree": {"h2": 25}}


def _kill_mid_allreduce(
    make_cluster: Callable[..., LocalCluster],
    tmp_path: Path,
    kill: Callable[[LocalCluster, Any], None],
    algorithm: str,
) -> list[Any]:
    """r0, r1 (threads) and r2 (a process on h2) all-reduce 16 MB over 100 Mbit/s; ``kill`` hits r2's side."""
    rates = KILL_RATES[algorithm]
    elements = 2 << 20
    graph = star(["h0", "h1", "h2", "h3"], {h: rates.get(h, 100) * 1e6 for h in ("h0", "h1", "h2", "h3")})
    plan = plan_allreduce(graph, [("r0", "h0"), ("r1", "h1"), ("r2", "h2")], elements * 8)
    assert plan.kind == algorithm, plan  # what the scheduler will run on this (declared) graph
    cluster = make_cluster(mbps=100, enforce=True, rates=rates)
    groups = [
        mlfabric.join_allreduce("job-k", world_size=3, participant=f"r{i}", daemon=cluster.socket(h))
        for i, h in enumerate(["h0", "h1"])
    ]
    try:
        handles = [
            g.allreduce_async({"w": np.full(elements, float(i + 1))}, timeout=120)
            for i, g in enumerate(groups)
        ]
        marker = tmp_path / "submitted"
        proc = cluster.spawn(
            "h2", [sys.executable, str(PARTICIPANT), "job-k", "2", "3", str(elements), str(marker)]
        )
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert proc.popen.poll() is None, proc.log_tail()
            assert time.monotonic() < deadline, "the participant process never submitted"
            time.sleep(0.02)
        time.sleep(0.3)  # chunks are moving (16 MB takes > 1 s at 100 Mbit/s either way)
        assert not all(h.done() for h in handles), "finished before the kill: the test would prove nothing"
        kill(cluster, proc)
        start = time.monotonic()
        results = []
        for h in handles:
            try:
                results.append(h.wait(timeout=60))
            except mlfabric.MlfabricError as exc:
                results.append(exc)
        assert time.monotonic() - start < 30
        return results
    finally:
        for g in groups:
            g.close()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_a_participant_process_killed_mid_allreduce_fails_the_others(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, algorithm: str
) -> None:
    results = _kill_mid_allreduce(
        make_cluster, tmp_path, lambda c, p: p.popen.send_signal(signal.SIGKILL), algorithm
    )
    for r in results:
        assert isinstance(r, mlfabric.MlfabricError), r
        assert r.code in ("allreduce_peer_lost", "allreduce_failed"), r.code
        assert "r2" in str(r), str(r)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_a_participant_daemon_killed_mid_allreduce_fails_the_others(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, algorithm: str
) -> None:
    def kill_daemon(cluster: LocalCluster, _proc: Any) -> None:
        daemon = next(p for p in cluster.processes() if p.name == "daemon-h2")
        daemon.popen.send_signal(signal.SIGKILL)

    results = _kill_mid_allreduce(make_cluster, tmp_path, kill_daemon, algorithm)
    for r in results:
        assert isinstance(r, mlfabric.MlfabricError), r
        assert r.code in ("allreduce_peer_lost", "allreduce_failed"), r.code
        assert "h2" in str(r) or "r2" in str(r), str(r)


@pytest.mark.slow
def test_a_layout_that_does_not_add_up_is_refused_and_a_world_of_one_returns_its_own(
    cluster: LocalCluster,
) -> None:
    from mlfabric import tensorio
    from mlfabric.localclient import connect
    from mlfabric.proto.v1 import dataplane_pb2, local_pb2

    fd, _, _ = tensorio.to_memfd({"w": np.ones(2)})
    client = connect(cluster.socket("h0"))
    try:
        bad = dataplane_pb2.TensorLayout(name="w", dtype="float64", shape=[2], offset=0, nbytes=16)
        request = local_pb2.LocalRequest(
            allreduce=local_pb2.AllreduceRequest(
                job="j", name="x", seq=1, participant="p", world_size=1, tensors=[bad],
                payload_bytes=24, has_payload=True,
            )
        )  # fmt: skip
        with pytest.raises(mlfabric.MlfabricError, match="covers 16 bytes but payload_bytes is 24") as info:
            client.call(request, fd, timeout=30)
        assert info.value.code == "bad_tensor"
    finally:
        client.close()
        os.close(fd)
    with mlfabric.join_allreduce("j", world_size=1, participant="alone", daemon=cluster.socket("h1")) as g:
        x = np.arange(7.0)
        np.testing.assert_array_equal(g.allreduce({"x": x}, timeout=30)["x"], x)  # a world of one
