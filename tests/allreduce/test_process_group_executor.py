"""All-reduces run in the training processes over a gloo process group (mlfabric/torch/executor.py):
exact sums by tree and by the native collective, plans kept between calls, a pushed plan adopted
at the same call by every rank, mismatches named, a vanished peer reported.

Real processes (torch.multiprocessing, gloo on loopback); the plan source is a stand-in for the
scheduler (it counts requests and hands out fixed plans).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

pytestmark = pytest.mark.slow

TREE = {0: None, 1: 0, 2: 0, 3: 1}  # rank 3 under rank 1: two levels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _values(n: int, rank: int, dtype: Any = np.float32) -> np.ndarray:
    return ((np.arange(n) % 97) * (rank + 1)).astype(dtype)


def _expected(n: int, world: int, dtype: Any = np.float32) -> np.ndarray:
    return ((np.arange(n) % 97) * sum(range(1, world + 1))).astype(dtype)


def _scenarios(rank: int, world: int, port: int, out: Any) -> None:
    from mlfabric.localclient import MlfabricError
    from mlfabric.torch.collective import RankPlan
    from mlfabric.torch.executor import AGREE_EVERY, GroupExecutor

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    asked: list[tuple[str, int]] = []
    plans = {
        "tree": RankPlan.tree(TREE, chunk_bytes=4096, epoch=0, description="tree"),
        "native": RankPlan.native(epoch=0, description="native"),
    }

    def plan_source(name: str, layouts: Any, sig: int, r: int) -> Any:
        asked.append((name, r))
        return plans["tree" if name.startswith("t") else "native"]

    ex = GroupExecutor(dist.group.WORLD, plan_source, timeout=20)
    ex.start()
    report: dict[str, Any] = {"rank": rank}
    try:
        # exact sums, tree and native, several dtypes in one operation, numpy and torch
        n = 10_000
        for name in ("tree-op", "native-op"):
            for _ in range(3):
                h = ex.submit(name, {"a": _values(n, rank), "b": _values(7, rank, np.float64)}, seq=0)
                total = h.wait(30)
                assert np.array_equal(total["a"], _expected(n, world)), name
                assert np.array_equal(total["b"], _expected(7, world, np.float64)), name
        small = torch.arange(n) % 8  # bfloat16 holds these sums exactly
        total_t = ex.submit("t-bf16", {"w": (small * (rank + 1)).to(torch.bfloat16)}, seq=0).wait(30)["w"]
        assert total_t.dtype == torch.bfloat16
        assert torch.equal(total_t, (small * sum(range(1, world + 1))).to(torch.bfloat16))
        report["asked"] = sorted(set(asked))
        report["asks"] = len(asked)
        # a plan pushed at different times: rank 0 gets epoch 1 now, the others a call later
        newer = RankPlan.native(epoch=1, description="pushed")
        if rank == 0:
            ex.on_plan("tree-op", _sig("tree-op", n), newer)
        h1 = ex.submit("tree-op", {"a": _values(n, rank), "b": _values(7, rank, np.float64)}, seq=0)
        h1.wait(30)
        report["first_after_push"] = h1.plan
        if rank != 0:
            ex.on_plan("tree-op", _sig("tree-op", n), newer)
        h2 = ex.submit("tree-op", {"a": _values(n, rank), "b": _values(7, rank, np.float64)}, seq=0)
        assert np.array_equal(h2.wait(30)["a"], _expected(n, world))
        report["second_after_push"] = h2.plan
        # a trusted operation (DDP's buckets) agrees only every AGREE_EVERY calls: a pushed plan
        # is adopted at the next such call
        trusted = []
        for call in range(AGREE_EVERY + 2):
            if call == 3:
                ex.on_plan(
                    "t-trusted", _sig_one("t-trusted", n), RankPlan.native(epoch=5, description="later")
                )
            h = ex.submit(
                "t-trusted", {"a": torch.from_numpy(_values(n, rank))}, seq=0, inplace=True, trusted=True
            )
            assert torch.equal(h.wait(30)["a"], torch.from_numpy(_expected(n, world)))
            trusted.append(h.plan)
        report["trusted"] = trusted
        # a mismatch: rank 2's tensor is shorter; every rank gets allreduce_mismatch naming it
        length = n - 1 if rank == 2 else n
        try:
            ex.submit("tree-op", {"a": _values(length, rank)}, seq=0).wait(30)
            report["mismatch"] = "none"
        except MlfabricError as exc:
            report["mismatch"] = (exc.code, str(exc))
        # still usable afterwards
        again = ex.submit("native-op", {"a": _values(n, rank), "b": _values(7, rank, np.float64)}, seq=0)
        assert np.array_equal(again.wait(30)["a"], _expected(n, world))
        # a peer vanishes: rank 3 exits; the others get allreduce_peer_lost (or a timeout)
        if rank == 3:
            _leave(out, report)
        time.sleep(0.5)
        try:
            ex.submit("tree-op", {"a": _values(n, rank), "b": _values(7, rank, np.float64)}, seq=0).wait(60)
            report["lost"] = "none"
        except MlfabricError as exc:
            report["lost"] = exc.code
        try:
            ex.submit("native-op", {"a": _values(n, rank)}, seq=0).wait(60)
            report["after_lost"] = "none"
        except MlfabricError as exc:
            report["after_lost"] = exc.code
    except BaseException:  # noqa: BLE001 - reported to the test process, which fails on it
        report["error"] = traceback.format_exc()
    _leave(out, report)


def _leave(out: Any, report: dict[str, Any]) -> None:
    """Hand the report over (flushed) and exit without waiting for the broken group."""
    out.put(report)
    out.close()
    out.join_thread()
    os._exit(0)


def _sig_one(name: str, n: int) -> int:
    from mlfabric.torch.collective import signature

    return signature(name, [("a", "float32", (n,))])


def _sig(name: str, n: int) -> int:
    from mlfabric.torch.collective import signature

    return signature(name, [("a", "float32", (n,)), ("b", "float64", (7,))])


def test_executor_sums_keeps_plans_adopts_pushed_plans_and_names_failures() -> None:
    world = 4
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_scenarios, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    reports = [out.get(timeout=240) for _ in range(world)]
    for p in procs:
        p.join(30)
    by_rank = {r["rank"]: r for r in reports}
    for r in reports:
        assert "error" not in r, r["error"]
    for rank in range(world):
        r = by_rank[rank]
        # one plan request per operation, however many calls
        assert r["asks"] == 3 and r["asked"] == [("native-op", rank), ("t-bf16", rank), ("tree-op", rank)]
        trusted = r["trusted"]
        assert trusted[:16] == ["tree"] * 16 and trusted[16:] == ["later"] * 2
        # the pushed plan is used only once every rank holds it
        assert r["first_after_push"] == "tree" and r["second_after_push"] == "pushed"
        code, message = r["mismatch"]
        assert code == "allreduce_mismatch" and "[2]" in message
    for rank in range(3):
        assert by_rank[rank]["lost"] in ("allreduce_peer_lost", "allreduce_timeout")
        assert by_rank[rank]["after_lost"] == by_rank[rank]["lost"]
